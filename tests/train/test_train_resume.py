"""Checkpoints and exact resume: a run stopped at a safe point (reporter.should_stop) and resumed from its
checkpoint reproduces the uninterrupted run's next steps exactly on CPU (metrics and weights); checkpoints are
written atomically and pruned to save_total_limit; the CLI writes the run directory.

Run: python -m pytest tests/train/test_train_resume.py -q
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from worker.tlt.build import reward_names_for
from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.job_spec_file import load_spec
from worker.tlt.rl.checkpoint import clean_partial, latest_checkpoint, list_checkpoints
from worker.tlt.train import main, run

VOLATILE = ("timing_s/", "perf/")  # wall-clock metrics differ between any two runs


class StopAfter(FileReporter):
    """Asks the loop to stop once `n` steps have reported metrics (a cancel arriving mid-run)."""

    def __init__(self, run_dir: Path, n: int) -> None:
        super().__init__(run_dir)
        self.n = n

    def should_stop(self) -> bool:
        return len(read_metrics(self.run_dir)) >= self.n


def _stable(rec: dict) -> dict:
    return {k: v for k, v in rec["metrics"].items() if not k.startswith(VOLATILE)}


def test_resumed_run_reproduces_the_uninterrupted_run(tmp_path: Path, toy_spec) -> None:
    spec = toy_spec({"lr_scheduler_type": "linear", "warmup_steps": 1}, max_steps=4, save_steps=3, save_total_limit=1)
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(spec, full, FileReporter(full))
    run(spec, cut, StopAfter(cut, 2))  # stops after step 2 and checkpoints there (save_steps=3 would not)
    assert [r["step"] for r in read_metrics(cut)] == [1, 2]
    assert latest_checkpoint(cut / "checkpoints").name == "step-2"
    run(spec, cut, FileReporter(cut))  # resumes from step-2
    a, b = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert _stable(ra) == _stable(rb), ra["step"]
    wa = load_file(str(full / "checkpoints/step-4/model.safetensors"))
    wb = load_file(str(cut / "checkpoints/step-4/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # retention: save_total_limit=1 keeps only the newest; the export is complete
    assert [p.name for _, p in list_checkpoints(full / "checkpoints")] == ["step-4"]
    assert (full / "policy/model.safetensors").exists()
    kinds = [json.loads(x)["kind"] for x in (full / "artifacts.jsonl").read_text().splitlines()]
    assert kinds == ["checkpoint", "checkpoint", "policy", "tensorboard"]


def test_partial_checkpoint_is_ignored_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step-3").mkdir(parents=True)
    (root / ".tmp-step-5-123").mkdir()  # a save interrupted before its rename
    assert latest_checkpoint(root).name == "step-3"
    clean_partial(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]


def test_cli_runs_a_spec_file_and_honours_stop(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: cli\nmodel: {builtin: tiny-qwen2}\n"
        "dataset: {builtin: toy-count, system_prompt: null, validation_size: 2, max_prompt_length: 64}\n"
        "algorithm: {num_generations: 2, prompts_per_step: 2, max_completion_length: 4, reward_funcs: [toy_count]}\n"
        "rollout: {speculative: 'off', kv_cache_gb: 0.05}\nmax_steps: 2\nsave_steps: 1\neval_steps: 1\n"
    )
    out = tmp_path / "run"
    assert main([str(spec), "--run-dir", str(out)]) == 0
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == [1, 2] and "val/pass@1" in recs[0]["metrics"]
    hist = [json.loads(x) for x in (out / "histograms.jsonl").read_text().splitlines()]
    assert hist[0]["name"] == "response_length" and sum(hist[0]["counts"]) == 4
    assert (out / "samples.jsonl").exists() and "step 2/2" in (out / "train.log").read_text()
    (out / "STOP").touch()  # a second invocation with more steps stops at once, before any step
    spec.write_text(spec.read_text().replace("max_steps: 2", "max_steps: 5"))
    assert main([str(spec), "--run-dir", str(out)]) == 0
    assert len(read_metrics(out)) == 2


def test_spec_file_overrides_a_preset_section_by_section(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("algorithm: {max_completion_length: 8}\nmax_steps: 1\n")
    spec = load_spec(str(f), "demo-cpu")
    assert spec.algorithm.max_completion_length == 8 and spec.algorithm.num_generations == 4  # preset's kept
    assert spec.max_steps == 1 and spec.name == "demo-smollm2-toy-times"


def test_builtin_task_brings_its_reward_unless_the_spec_names_one() -> None:
    toy = {"model": {"builtin": "tiny-llama"}, "dataset": {"builtin": "toy-count"}}
    assert reward_names_for(JobSpec.model_validate(toy)) == ["toy_count"]
    explicit = {**toy, "algorithm": {"reward_funcs": ["format"]}}
    assert reward_names_for(JobSpec.model_validate(explicit)) == ["format"]
    assert reward_names_for(JobSpec.model_validate({})) == ["math_accuracy"]


def test_adaptive_bandit_state_is_checkpointed_and_restored(tmp_path: Path, toy_spec) -> None:
    """Adaptive SD: what the bandit learned survives a resume (its arm statistics are not re-learned from zero)."""
    from worker.tlt.build import build_trainer
    from worker.tlt.run_dir import resume_from

    spec = toy_spec(max_steps=2, save_steps=2, drafter={"kind": "ngram"},  # 8 sequences: SD on from the first step
                    rollout={"speculative": "adaptive", "sd_on_below": 16, "sd_patience": 1, "kv_cache_gb": 0.05,
                             "sd_switch": "active_batch"})  # the threshold: on CPU the cost switch keeps SD off
    run(spec, tmp_path, FileReporter(tmp_path))
    saved = torch.load(tmp_path / "checkpoints/step-2/extra.pt", weights_only=False)["adaptive"]["bandit"]
    assert any(st["round"] > 0 for st in saved["buckets"].values())  # the bandit played during the rollouts
    trainer, _ = build_trainer(spec, FileReporter(tmp_path / "fresh"))
    assert trainer.rollout.sd_controller.state_dict()["bandit"] != saved
    assert resume_from(trainer, tmp_path / "checkpoints") == 2
    assert trainer.rollout.sd_controller.state_dict()["bandit"] == saved


def test_step_costs_and_bandit_are_checkpointed_and_restored_exactly(tmp_path: Path, toy_spec) -> None:
    """The cost switch's measured step costs (per bucket: plain and SD step seconds, tokens per SD step, verdicts)
    and the bandit survive a resume as they were saved, so a resumed job does not probe SD afresh."""
    from worker.tlt.build import build_trainer
    from worker.tlt.run_dir import resume_from

    spec = toy_spec(max_steps=2, save_steps=2, drafter={"kind": "ngram"},
                    rollout={"speculative": "adaptive", "sd_switch": "step_costs", "sd_on_below": 16,
                             "sd_patience": 1, "kv_cache_gb": 0.05})
    run(spec, tmp_path, FileReporter(tmp_path))
    saved = torch.load(tmp_path / "checkpoints/step-2/extra.pt", weights_only=True)["adaptive"]
    costs = saved["step_costs"]
    assert costs is not None and costs["observed_s"] > 0
    assert any(b["plain_n"] > 0 for b in costs["buckets"].values())  # plain steps were measured ...
    assert any(b["arms"] for b in costs["buckets"].values())  # ... and SD steps (free probes on CPU)
    trainer, _ = build_trainer(spec, FileReporter(tmp_path / "fresh"))
    ctl = trainer.rollout.sd_controller
    assert ctl is not None and ctl.state_dict()["step_costs"] != costs
    assert resume_from(trainer, tmp_path / "checkpoints") == 2
    assert ctl.state_dict() == saved  # step costs, bandit and dropped arms, exactly
    assert ctl.costs is not None and ctl.switch.costs is ctl.costs  # restored in place: the switch reads them
    trainer.close()
