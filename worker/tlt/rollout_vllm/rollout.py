"""`VllmRollout`: the trainer's `Rollout` (rl/rollout_io.py) on an in-process vLLM, for `rollout.backend: vllm`.

    rollout = make_vllm_rollout(spec, model, tokenizer, device)
    trajs, metrics = rollout(prompts, n=8, greedy=False)   # the same Trajectory our engine returns
    rollout.on_weights_updated()                           # after each optimizer step: the weights into vLLM

Sampling is our engine's (job_spec_translate.py `request_sampling`): n samples per prompt, temperature, top-p, top-k,
max_completion_length new tokens, stop at the tokenizer's EOS ids (the EOS token kept in the response, finish reason
"stop"; "length" at the cap). Each token's log-prob is vLLM's of the processed distribution (after temperature /
top-k / top-p, `logprobs_mode="processed_logprobs"`), as our engine reports it, so the trainer's recompute gives the
same `rollout/logp_abs_diff` metric. Request seeds come from `generator` (checkpointed like the engine's): a resumed
run draws the same seeds.
Weight sync (`on_weights_updated`): the trainer's state dict under HF names (model/hf_names.py `to_hf`) loaded into
vLLM in place, no files written; only at construction is the policy exported once (export/hf.py) for vLLM to load.
`rollout.release_kv_for_update` (CUDA): vLLM sleeps (KV cache freed, weights offloaded) after each training rollout;
the sync wakes its weights, the next rollout the rest. SD (`rollout.speculative: on`): vLLM drafts `draft_depth`
tokens with the job's online drafter (rollout_vllm/drafter.py), exported once at construction with our exporter.
With SD on, vLLM 0.32's CPU build reports NaN for the processed log-probs of tokens emitted by speculative steps:
such responses carry no log-probs (Trajectory.logprobs None), so `rollout/logp_abs_diff` is then not reported; the
update never trains on them (the trainer recomputes its own).
Metrics: sd/on_fraction (1 when vLLM drafted), sd/accept_len (tokens per sequence per verify), sd/accepted_draft_tokens,
sd/verify_steps, from vLLM's own spec-decoding counters; `timing_s/kv_restore` and `timing_s/sleep` with sleep mode.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.job_spec_translate import drafter_config, request_sampling
from worker.tlt.model.hf_names import to_hf
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.rollout_io import FinishCallback, Trajectory
from worker.tlt.rollout.types import RequestSampling
from worker.tlt.rollout_backends import backend_refusals
from worker.tlt.rollout_vllm.drafter import VllmDrafter
from worker.tlt.rollout_vllm.llm import VllmEngine
from worker.tlt.rollout_vllm.settings import vllm_settings

log = logging.getLogger(__name__)
SEED_RANGE = 2**31 - 1


def spec_metrics(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """sd/* of one generate() from vLLM's cumulative counters before and after it."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    m = {"sd/on_fraction": 1.0 if drafts else 0.0}
    if drafts:
        m.update({"sd/accept_len": 1.0 + accepted / drafts, "sd/accepted_draft_tokens": float(accepted),
                  "sd/verify_steps": float(drafts)})
    return m


class VllmRollout:
    def __init__(self, engine: VllmEngine, model: Transformer, sampling: RequestSampling, eos_ids: Sequence[int],
                 seed: int, release_kv: bool = False, drafter: VllmDrafter | None = None) -> None:
        self.engine, self.model, self.sampling = engine, model, sampling
        self.eos_ids, self.release_kv, self.drafter = tuple(eos_ids), release_kv, drafter
        self.gen = torch.Generator().manual_seed(seed)
        self.loaded: list[str] = []  # vLLM's parameters the last weight sync wrote

    @property
    def generator(self) -> torch.Generator:
        return self.gen

    @property
    def sd_controller(self) -> None:
        return None  # vLLM decides nothing across steps that a checkpoint must keep

    def __call__(self, prompts: Sequence[RenderedPrompt], n: int, greedy: bool,
                 on_finish: FinishCallback | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        s = self.sampling.greedy() if greedy else self.sampling
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        self.engine.wake()  # asleep since the last training rollout (sleep mode): KV cache back first
        if self.release_kv and not greedy:
            metrics["timing_s/kv_restore"] = time.perf_counter() - t0
        if self.drafter is not None and not greedy:
            self.drafter.begin_rollout()
        seed = int(torch.randint(0, SEED_RANGE, (1,), generator=self.gen))
        before = self.engine.spec_counts()
        outs = self.engine.generate([p.ids for p in prompts], temperature=s.temperature, top_p=s.top_p,
                                    top_k=s.top_k, max_tokens=s.max_new_tokens, n=n, seed=seed,
                                    stop_token_ids=self.eos_ids)
        metrics.update(spec_metrics(before, self.engine.spec_counts()))
        trajs = [self._trajectory(prompts[i], c) for i, o in enumerate(outs) for c in o.outputs]
        if on_finish is not None:
            for i, t in enumerate(trajs):
                on_finish(i, t)
        if self.release_kv and not greedy:  # the policy update comes next: hand it vLLM's memory
            t0 = time.perf_counter()
            self.engine.sleep()
            metrics["timing_s/sleep"] = time.perf_counter() - t0
        return trajs, metrics

    def _trajectory(self, prompt: RenderedPrompt, c: object) -> Trajectory:
        tokens = tuple(int(t) for t in c.token_ids)  # type: ignore[attr-defined]
        lps = c.logprobs  # type: ignore[attr-defined]  # per position: {token id: Logprob}, the sampled one included
        logprobs = tuple(float(lp[t].logprob) for t, lp in zip(tokens, lps, strict=True)) if lps else None
        if logprobs is not None and any(x != x for x in logprobs):  # NaN: see the module docstring
            logprobs = None
        reason = "length" if c.finish_reason == "length" else "stop"  # type: ignore[attr-defined]
        return Trajectory(prompt, tokens, logprobs, reason)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The trainer's weights under HF names (fused projections split; views where nothing is split), the head
        always its own tensor (vLLM serves the policy untied: `untie_head`)."""
        with torch.no_grad():
            out = to_hf({k: v.detach() for k, v in self.model.state_dict().items()}, self.model.args)
            out["lm_head.weight"] = self.model.head_weight.detach()
            return out

    def on_weights_updated(self) -> None:
        """The optimizer step's weights into vLLM, in place."""
        self.loaded = self.engine.load_policy(self.policy_weights().items())

    def close(self) -> None:
        self.engine.close()


def untie_head(policy_dir: Path, model: Transformer) -> Path:
    """The exported policy with its head written as a tensor of its own (tie_word_embeddings false). vLLM's in-place
    reload re-processes each layer's weights, and a head tied to the embedding kept the old tensor (vLLM 0.32): an
    untied head is loaded like any other weight. The values, and so the outputs, are the same."""
    import json

    from safetensors.torch import load_file, save_file

    cfg_path, weights_path = policy_dir / "config.json", policy_dir / "model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tie_word_embeddings"):
        tensors = load_file(str(weights_path))
        tensors["lm_head.weight"] = model.head_weight.detach().to("cpu", tensors["model.embed_tokens.weight"].dtype)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights_path), metadata={"format": "pt"})
        cfg_path.write_text(json.dumps({**cfg, "tie_word_embeddings": False}, indent=2))
    return policy_dir


def make_vllm_rollout(spec: JobSpec, model: Transformer, tokenizer: TokenizerLike, device: torch.device
                      ) -> VllmRollout:
    """A vLLM engine loaded from a one-time export of the policy (and of the online drafter with SD on)."""
    refused = backend_refusals(spec)
    if refused:
        raise ValueError("rollout.backend vllm cannot run this spec: " +
                         "; ".join(f"{'.'.join(loc)}: {why}" for loc, why in refused))
    from worker.tlt.export.hf import export_policy
    from worker.tlt.speculative.drafter.export import export_drafter
    from worker.tlt.speculative.drafter.online import OnlineDrafter

    settings = vllm_settings(spec, model, device)
    online = OnlineDrafter(drafter_config(spec), model) if settings.speculative else None
    with tempfile.TemporaryDirectory(prefix="tlt-vllm-") as tmp:  # vLLM reads the files while it is built
        policy_dir = untie_head(export_policy(model, tokenizer, Path(tmp) / "policy"), model)
        drafter_dir = None
        if online is not None:
            drafter_dir = export_drafter(online.train_drafter, Path(tmp) / "drafter", dtype=model.head_weight.dtype)
        engine = VllmEngine(settings, str(policy_dir), str(drafter_dir) if drafter_dir else None)
    drafter = VllmDrafter(online, engine.load_drafter, model.head_weight.dtype) if online is not None else None
    log.info("rollout on vLLM: %s", settings)
    return VllmRollout(engine, model, request_sampling(spec), tokenizer.eos_ids, spec.rollout.seed + spec.seed,
                       spec.rollout.release_kv_for_update and settings.sleep_mode, drafter)
