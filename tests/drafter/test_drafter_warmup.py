"""The `drafter` job body: generate with the engine, train, report metrics, export a loadable drafter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.model import ByteTokenizer
from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.export import load_exported
from worker.tlt.speculative.drafter.warmup import warmup


class ListReporter:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.artifacts: list[tuple[str, Path]] = []
        self.lines: list[str] = []

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.rows.append((step, values))

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None:
        pass

    def log(self, line: str) -> None:
        self.lines.append(line)

    def artifact(self, kind: str, path: Path, step: int | None = None) -> None:
        self.artifacts.append((kind, path))

    def samples(self, step: int, rows: list[dict]) -> None:
        pass

    def should_stop(self) -> bool:
        return False


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_warmup_trains_and_exports(tmp_path, tiny_target: Transformer, kind: str) -> None:
    spec = JobSpec.model_validate({
        "type": "drafter", "model": {"builtin": "tiny-llama"}, "max_steps": 2,
        "algorithm": {"prompts_per_step": 2, "num_generations": 2, "max_completion_length": 16, "temperature": 1.0},
        "drafter": {"kind": kind, "max_train_steps_per_rl_step": 4, "buffer_gb": 0.01},
        "rollout": {"cuda_graphs": False},
    })
    tok = ByteTokenizer()
    prompts = [tok.encode(t) for t in ("count: 1 2 3", "abc abc ab", "hello")]
    rep = ListReporter()
    out = warmup(spec, tiny_target, tok, prompts, rep, out_dir=tmp_path / "drafter", eos_ids=(257,))
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert rep.artifacts == [("drafter", out)]
    assert [s for s, _ in rep.rows] == [0, 1]
    last = rep.rows[-1][1]
    assert last["drafter/steps"] == 8 and "drafter/loss" in last and last["timing_s/gen"] > 0
    back = load_exported(out, tiny_target)
    assert back.cfg.kind == kind
    assert all(torch.isfinite(p).all() for p in back.parameters())


def test_warmup_keeps_every_rounds_responses(tmp_path, tiny_target: Transformer) -> None:
    """The target is frozen during a warm-up: round 3 still trains on round 1's responses (an RL step's buffer keeps
    only the last two steps)."""
    rounds, n, length = 3, 2, 12
    spec = JobSpec.model_validate({
        "type": "drafter", "model": {"builtin": "tiny-llama"}, "max_steps": rounds,
        "algorithm": {"prompts_per_step": n, "num_generations": 2, "max_completion_length": length},
        "drafter": {"kind": "eagle1", "max_train_steps_per_rl_step": 1, "buffer_gb": 0.01},
        "rollout": {"cuda_graphs": False},
    })
    tok = ByteTokenizer()
    rep = ListReporter()
    warmup(spec, tiny_target, tok, [tok.encode("abc"), tok.encode("hello")], rep, out_dir=tmp_path / "d", eos_ids=())
    # no EOS: every response runs `length` tokens = `length` rows (the prompt's last row, then all but the last token)
    assert [m["drafter/buffer_rows"] for _, m in rep.rows] == [n * length * (r + 1) for r in range(rounds)]


def test_warmup_engine_comes_from_the_spec_translation(tiny_target: Transformer) -> None:
    """The warm-up's engine is sized by the same translation as the rollout's (job_spec_translate.py): prompt +
    completion columns, the KV budget with its verify slack, the rollout's seed, graphs and kernels; one sequence
    per prompt of a round resident."""
    from worker.tlt.job_spec_translate import engine_config, max_len, warmup_engine_config

    spec = JobSpec.model_validate({
        "type": "drafter", "model": {"builtin": "tiny-llama"}, "seed": 5,
        "dataset": {"builtin": "toy-count", "max_prompt_length": 40},
        "algorithm": {"prompts_per_step": 3, "num_generations": 4, "max_completion_length": 16},
        "rollout": {"seed": 2, "cuda_graphs": False, "kv_cache_gb": 0.05},
    })
    cfg, rollout_cfg = warmup_engine_config(spec, tiny_target), engine_config(spec, tiny_target)
    assert cfg.max_slots == 3 and rollout_cfg.max_slots == 12
    assert cfg.max_len == max_len(spec) == 56 and cfg.seed == 7 and not cfg.cuda_graphs
    assert cfg == rollout_cfg.__class__(**{**rollout_cfg.__dict__, "max_slots": 3})  # nothing else differs
