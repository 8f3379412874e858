"""The real model end to end: 3 GRPO steps of SmolLM2-135M-Instruct on GSM8K (2 prompts x 2 samples, 16 new
tokens) through `run`: finite loss, every metric of REQUIRED present each step, checkpoints, and an HF export that
transformers loads with the same logits and tokenizer.

Run: python -m pytest tests/train/test_train_smollm2_grpo.py -q      (a few minutes on 2 busy cores)
"""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.model.args import ModelArgs
from worker.tlt.model.load import build_model, load_hf_state_dict
from worker.tlt.train import run

REQUIRED = [
    *(f"response_length/{k}" for k in ("mean", "max", "min", "p50", "p90", "clip_ratio")),
    "reward/mean", "reward/std", "frac_reward_zero_std",
    *(f"actor/{k}" for k in ("pg_loss", "entropy", "kl", "grad_norm", "clipfrac", "lr")),
    *(f"timing_s/{k}" for k in ("gen", "reward", "update", "sync", "drafter", "step")),
    "perf/tokens_per_s", "sd/on_fraction", "rollout/logp_abs_diff",
]


@pytest.mark.slow
def test_three_grpo_steps_on_smollm2(tmp_path: Path) -> None:
    spec = JobSpec.model_validate({
        "model": {"builtin": "smollm2-135m-instruct"},
        "dataset": {"builtin": "gsm8k", "validation_size": 0, "max_prompt_length": 128},  # short prompts only
        "algorithm": {"num_generations": 2, "prompts_per_step": 2, "max_completion_length": 16,
                      "learning_rate": 1e-6, "reward_funcs": ["math_accuracy", "format"]},
        "rollout": {"speculative": "off", "kv_cache_gb": 0.2},
        "max_steps": 3, "save_steps": 3,
    })
    run(spec, tmp_path, FileReporter(tmp_path))
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        m = r["metrics"]
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, missing
        assert all(v is not None and math.isfinite(v) for v in m.values())
        assert m["response_length/max"] <= 16 and m["actor/lr"] == pytest.approx(1e-6)
        # the trainer's recompute and the engine's own log-probs of the sampled tokens agree (fp32 CPU)
        assert m["rollout/logp_abs_diff"] < 1e-3
    assert (tmp_path / "checkpoints/step-3/optimizer.pt").is_file()

    policy = tmp_path / "policy"
    tok = AutoTokenizer.from_pretrained(policy)
    hf = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    ours = build_model(ModelArgs.from_hf_config(json.loads((policy / "config.json").read_text())),
                       load_hf_state_dict(policy), "cpu", torch.float32)
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-3)
