"""The drafter-recipe measurement (worker/tlt/speculative/drafter/measure.py): per-position acceptance arithmetic, and a CPU smoke
run that trains EAGLE-1 recipes on one buffer, evaluates them (with a draft vocabulary too) and exports the best, and
an EAGLE-3 recipe trained on teacher-forced rows of the same responses."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from worker.tlt.model import preset, random_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.types import RequestSampling
from worker.tlt.speculative.drafter import measure
from worker.tlt.speculative.drafter.export import load_exported
from worker.tlt.speculative.drafter.measure import RECIPES


def test_position_sums_add_steps_of_different_depths() -> None:
    steps = [SimpleNamespace(accepted_pos=(3, 1), drafted_pos=(4, 4)),
             SimpleNamespace(accepted_pos=(2, 2, 1), drafted_pos=(2, 2, 2))]
    assert measure.position_sums(steps, "accepted_pos") == [5, 3, 1]
    assert measure.position_sums(steps, "drafted_pos") == [6, 6, 2]


def test_conditional_rates_and_accept_length_at_a_shallower_depth() -> None:
    r = {"spec_rows": 10, "accepted_pos": [6, 3, 0], "drafted_pos": [10, 10, 10]}
    assert measure.conditional_rates(r) == pytest.approx([0.6, 0.5, 0.0])
    assert measure.accept_len_at(r, 1) == pytest.approx(1.6)  # 1 emitted token + 6 of 10 rows accepted position 1
    assert measure.accept_len_at(r, 3) == pytest.approx(1.9)
    # no speculative step at all: plain decoding emits one token per row per step
    assert measure.accept_len_at({"spec_rows": 0, "accepted_pos": [], "drafted_pos": []}, 4) == 1.0


def test_recipe_smoke_run_exports_the_longest_chain(tmp_path: Path) -> None:
    out, exported = tmp_path / "m.json", tmp_path / "best"
    rc = measure.main(["--device", "cpu", "--model", "tiny-llama", "--train-prompts", "5", "--gen-chunk", "2",
                       "--train-steps", "3", "--checkpoints", "1", "--new-tokens", "12", "--eval-prompts", "2",
                       "--recipes", "eagle1,eagle1-ttt2", "--draft-vocab", "0,64", "--export", str(exported),
                       "--out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["buffer_rows"]["eagle1"] >= 5  # three engine runs of <= 2 prompts: each prompt's last row at least
    res = summary["results"]
    chains = [r for r in res if r["arm"] == "chain k=6"]
    # every recipe evaluated after 1 step and after all 3
    assert {(r["recipe"], r["draft_vocab"], r["train"]["steps"]) for r in chains} == {
        (n, v, s) for n in ("eagle1", "eagle1-ttt2") for v in (0, 64) for s in (1, 3)}
    for r in chains:
        assert len(r["accepted_pos"]) == len(r["drafted_pos"]) <= 6
        assert all(a <= d for a, d in zip(r["accepted_pos"], r["drafted_pos"], strict=True))
        assert r["accept_len"] <= measure.accept_len_at(r, 6) + 1e-9  # EOS / budget cuts only shorten a run
    target = random_model(preset("tiny-llama"), seed=0)
    assert load_exported(exported, target).cfg.kind == "eagle1"


def test_eagle3_recipe_trains_on_teacher_forced_rows_of_the_same_responses(tiny_target: Transformer) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = RequestSampling(temperature=1.0, max_new_tokens=6)
    resp = measure.generate_responses(tiny_target, prompts, params, eos=(), max_len=16, gb=0.01)
    buf3 = measure.buffer_for(tiny_target, resp, "eagle3", gb=0.01)
    # each prompt's last position + its responses; the engine hook never computes the last response token's hidden
    # state, the teacher-forced forward does
    assert len(resp.buffers["eagle1"]) == 2 * 6 and len(buf3) == 2 * 7
    assert buf3.hidden.shape[-1] == 4 * tiny_target.args.dim  # 3 layers' inputs + the final hidden
    a = SimpleNamespace(batch=2, window=4, lr=1e-3, train_steps=3, buffer_gb=0.01)
    (drafter, fig), = measure.train_recipe(tiny_target, resp, RECIPES["eagle3-ttt3"], a)
    assert drafter.cfg.kind == "eagle3" and fig["drafter/steps"] == 3 and math.isfinite(fig["drafter/loss"])


def test_checkpoints_past_the_training_budget_are_refused() -> None:
    with pytest.raises(SystemExit) as err:  # before anything loads or trains
        measure.main(["--device", "cpu", "--model", "tiny-llama", "--train-steps", "3", "--checkpoints", "2,5"])
    assert err.value.code == 2
