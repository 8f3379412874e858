"""`tlt selfcheck --model tiny --json` -- the command as a user runs it, default prompts and samples (~30 s on 2
cores) -- runs the whole lossless check and passes (`passed` includes its negative control: a wrong acceptance
rule caught).
Run: python -m pytest tests/engine/test_engine_selfcheck_cli.py -q"""

from __future__ import annotations

import json

import pytest
import torch

from worker.tlt.selfcheck import _greedy_plan, main


def test_selfcheck_tiny_passes(capsys) -> None:
    assert main(["--model", "tiny", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    progress = captured.err.splitlines()  # one line per check as it ends
    assert progress[0].startswith("selfcheck load tiny:")
    assert sum(ln.startswith("selfcheck greedy ") for ln in progress) == 1 + report["sequences"] // 12
    assert any(ln.startswith("selfcheck sampling negative control: p = ") for ln in progress)
    assert report["skipped_for_budget"] == []
    for key in ("sequences", "identical_sequences", "identical_token_fraction", "sampling_pvalue_min", "passed"):
        assert key in report
    assert report["passed"] and report["sequences"] == report["identical_sequences"] > 0
    assert report["identical_token_fraction"] == 1.0


def test_selfcheck_budget_skips_and_does_not_pass(capsys) -> None:
    """A spent budget starts no further check: the plain greedy reference and the first sampling setting (with the
    negative control) still run, every other check is named as skipped, and the run does not pass."""
    assert main(["--model", "tiny", "--json", "--budget-s", "0.001"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["passed"] is False and report["sequences"] == 0
    assert "greedy chain4/slots3" in report["skipped_for_budget"]
    assert "sampling chain2/T1.0/p1.0/k0" in report["skipped_for_budget"]
    assert list(report["sampling_pvalues"]) == ["plain/T1.0/p1.0/k0"]
    assert "selfcheck sampling negative control" in captured.err


def test_real_models_are_checked_in_fp32_unless_asked(monkeypatch, capsys) -> None:
    """In bf16 the engine's kernels and the reference forward part at near-ties (a top-k boundary moves), so a real
    model loads in fp32 by default; `--dtype auto` keeps the source's dtype."""
    from worker.tlt import selfcheck

    asked: list[object] = []

    def loader(source, device, dtype=None):  # type: ignore[no-untyped-def]
        asked.append(dtype)
        raise RuntimeError("stop after the load")

    monkeypatch.setattr(selfcheck, "load_model", loader)
    for flags, want in (([], torch.float32), (["--dtype", "auto"], None), (["--dtype", "bfloat16"], torch.bfloat16)):
        with pytest.raises(RuntimeError, match="stop after the load"):
            main(["--model", "smollm2-135m-instruct", "--device", "cpu", "--quiet", *flags])
        assert asked.pop() == want


def test_greedy_plan_covers_every_variant_and_slot_count() -> None:
    variants = [(name, None) for name in ("chain4", "chain8", "tree", "ngram", "ngram-tree")]
    plan = _greedy_plan(variants, (1, 8, 12))  # type: ignore[arg-type]
    assert [(n, s) for n, _, s in plan[:3]] == [("chain4", 1), ("chain4", 8), ("chain4", 12)]
    assert {n for n, *_ in plan} == {v[0] for v in variants} and len(plan) == 3 + 4
    assert {s for *_, s in plan[3:]} == {1, 8, 12}  # the other variants spread over every slot count


def test_one_engine_per_batch_shape_serves_every_variant(monkeypatch, capsys) -> None:
    """The greedy check builds one engine per slot count and the sampling check one per setting (their CUDA graphs
    are captured once per shape, not once per variant), and every variant still runs: the plain reference and each
    SD variant of the plan, on engines sized for the widest verify."""
    from worker.tlt import selfcheck

    built: list[int] = []
    real_init = selfcheck.SharedEngine.__init__

    def counting_init(self, target, drafter, eos, cfg, arms):  # type: ignore[no-untyped-def]
        built.append(cfg.max_slots)
        real_init(self, target, drafter, eos, cfg, arms)
        assert self.engine.max_nodes == max(a.verify_tokens for a in arms)

    monkeypatch.setattr(selfcheck.SharedEngine, "__init__", counting_init)
    assert main(["--model", "tiny", "--json", "--samples", "1500"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(built[:2]) == [3, 12] and len(built) == 2 + 3  # greedy: slot counts 3 and 12; sampling: 3 settings
    assert report["sequences"] == 12 * (2 + 4) and report["identical_sequences"] == report["sequences"]
    assert len(report["sampling_pvalues"]) == 3 * 3 and report["kernel_configs"].startswith("cached")
