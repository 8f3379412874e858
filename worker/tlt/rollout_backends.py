"""The rollout backends a job spec can name (`rollout.backend`) and what each can honour, without importing torch or
vLLM: the control plane refuses a spec at submit from these rules (backend/admission.py, a 422 that says why) and the
worker checks the same rules before it builds the rollout.

    backend_refusals(spec)      # [(loc, why), ...]: settings the chosen backend cannot honour; [] = runnable
    backend_installed("vllm")   # vLLM importable in this process (the `vllm` extra)

`tlt` is our adaptive engine (worker/tlt/rollout/): adaptive SD switching, the bandit, draft trees, the n-gram
drafter over GRPO siblings, idle-tail spot training. `vllm` is an in-process vLLM `LLM` (worker/tlt/rollout_vllm/):
other architectures, tensor parallelism, plain decoding or a fixed EAGLE chain with the job's online drafter.
"""

from __future__ import annotations

from importlib.util import find_spec

from worker.tlt.config import JobSpec

BACKENDS = ("tlt", "vllm")
OURS = "a feature of our engine (rollout.backend: tlt)"
# rollout settings that only steer our engine's adaptive SD: refused with vllm when a spec sets them at all
ADAPTIVE_ONLY = ("sd_switch", "sd_on_below", "sd_patience", "bandit", "verify_tokens")

Refusal = tuple[tuple[str, ...], str]


def backend_installed(name: str) -> bool:
    """Whether the backend's package imports here (tlt always does)."""
    return name == "tlt" or find_spec(name) is not None


def backend_refusals(spec: JobSpec) -> list[Refusal]:
    """Settings the spec's rollout backend cannot honour, each with its field and the reason."""
    return _vllm_refusals(spec) if spec.rollout.backend == "vllm" else _tlt_refusals(spec)


def _tlt_refusals(spec: JobSpec) -> list[Refusal]:
    if spec.resources.tensor_parallel > 1:
        return [(("resources", "tensor_parallel"), "tensor parallelism is the vLLM backend's (rollout.backend: "
                 "vllm); our engine runs one GPU per rank and spreads a job over GPUs by data parallelism")]
    return []


def _vllm_refusals(spec: JobSpec) -> list[Refusal]:
    ro, dr, res = spec.rollout, spec.drafter, spec.resources
    out: list[Refusal] = []
    if spec.type != "grpo":
        out.append((("rollout", "backend"), f"a {spec.type} job has no rollout: rollout.backend vllm applies to "
                    "grpo jobs"))
    if ro.speculative == "adaptive":
        out.append((("rollout", "speculative"), f"adaptive SD switching is {OURS}; with rollout.backend vllm set "
                    "rollout.speculative to off, or on (a fixed EAGLE chain of draft_depth tokens)"))
    for name in ADAPTIVE_ONLY:
        if name in ro.model_fields_set:
            out.append((("rollout", name), f"rollout.{name} steers adaptive SD (switching, the bandit, tree "
                        f"verification), {OURS}; the vLLM backend would ignore it"))
    if ro.draft_topk > 1:
        out.append((("rollout", "draft_topk"), f"draft trees are {OURS}; vLLM drafts a chain (draft_topk 1)"))
    if ro.fused_kernels:
        out.append((("rollout", "fused_kernels"), f"our fused Triton kernels are {OURS}; vLLM brings its own"))
    learned = dr.kind in ("eagle1", "eagle3")
    if ro.speculative == "on" and not learned:
        why = ("the n-gram drafter over GRPO siblings is " + OURS) if dr.kind == "ngram" else "it needs a drafter"
        out.append((("drafter", "kind"), f"SD through vLLM drafts with the job's online EAGLE-1 / EAGLE-3 drafter "
                    f"(drafter.kind eagle1 or eagle3); {dr.kind!r}: {why}"))
    if ro.speculative == "on" and learned:
        if not dr.train_after_update:
            out.append((("drafter", "train_after_update"), f"idle-tail spot training is {OURS}; with vLLM the "
                        "drafter trains after each policy update (train_after_update: true)"))
        if dr.draft_vocab_size:
            out.append((("drafter", "draft_vocab_size"), f"a reduced EAGLE-1 draft vocabulary is {OURS}; vLLM "
                        "drafts over the whole vocabulary (draft_vocab_size: 0)"))
        if res.update_engine == "deepspeed":
            out.append((("resources", "update_engine"), "the vLLM backend's drafter trains on the hidden states of "
                        "the torch update's forward; DeepSpeed's engine does not hand them over (update_engine: "
                        "torch or auto)"))
    if res.gpus == 0:
        if res.tensor_parallel > 1:
            out.append((("resources", "tensor_parallel"), "tensor parallelism needs GPUs (resources.gpus = "
                        "tensor_parallel); vLLM's CPU build runs one process"))
        if ro.release_kv_for_update:
            out.append((("rollout", "release_kv_for_update"), "releasing vLLM's KV cache for the update uses its "
                        "sleep mode, which needs CUDA; on CPU leave release_kv_for_update false"))
    elif res.gpus != res.tensor_parallel:
        out.append((("resources", "gpus"), f"with rollout.backend vllm the job's GPUs hold one model split by tensor "
                    f"parallelism: resources.gpus ({res.gpus}) must equal resources.tensor_parallel "
                    f"({res.tensor_parallel}); data parallelism over GPUs is our engine's"))
    return out
