"""The exports of a real `tlt train` run, served by their real consumer: vLLM's CPU build, installed in its own lane
(.lanes/vllm, scripts/lanes.sh; built here when missing) and driven by tests/vllm/vllm_greedy.py in that lane's
interpreter. One short SmolLM2 run per drafter form (EAGLE-1, EAGLE-3) exports the policy and its drafter; vLLM
loads the policy alone, then with each drafter as its speculative model. Greedy outputs with SD equal those without,
and both equal transformers'. vLLM's own spec-decoding counts (drafts, drafted and accepted tokens) are printed and
written to test-artifacts/vllm-acceptance.json.

Run: python -m pytest tests/vllm/test_vllm_serves_exports.py -q -s     (minutes: two short runs, three vLLM engines)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.vllm.lanes import REPO, ensure_lane, run_helper
from worker.cli import main as tlt

SPEC_TOKENS = 3  # num_speculative_tokens
NEW_TOKENS = 16
QUESTIONS = ["What is 12 + 30?", "Name three colours."]


@dataclass
class Exports:
    policy: Path
    drafters: dict[str, Path]  # vLLM's speculative method ("eagle" = EAGLE-1, "eagle3") -> drafter directory


def _train(root: Path, kind: str) -> Path:
    """One RL step of SmolLM2 through the CLI (`tlt train`), its online drafter of `kind` given one spot-training step."""
    spec = {
        "name": f"vllm-lane-{kind}",
        "model": {"builtin": "smollm2-135m-instruct"},
        "dataset": {"builtin": "gsm8k", "validation_size": 0, "max_prompt_length": 96},
        "algorithm": {"num_generations": 2, "prompts_per_step": 2, "max_completion_length": 16,
                      "learning_rate": 1e-6},
        # SD pinned on: the online drafter exists only where the engine drafts with it (no adaptive switching)
        "rollout": {"speculative": "on", "kv_cache_gb": 0.2},
        "drafter": {"kind": kind, "max_train_steps_per_rl_step": 1},
        "max_steps": 1,
    }
    path = root / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = root / kind
    assert tlt(["train", str(path), "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    root = tmp_path_factory.mktemp("vllm-lane")
    e3, e1 = _train(root, "eagle3"), _train(root, "eagle1")
    return Exports(policy=e3 / "policy", drafters={"eagle": e1 / "drafter", "eagle3": e3 / "drafter"})


@pytest.fixture(scope="module")
def prompts(exports: Exports) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(exports.policy)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def served(exports: Exports, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """vLLM's greedy tokens and spec-decoding counts: the policy alone, then with each drafter (one engine each)."""
    python = ensure_lane("vllm") / "bin/python"
    configs: dict = {"plain": None}
    for method, drafter in exports.drafters.items():
        configs[method] = {"method": method, "model": str(drafter), "num_speculative_tokens": SPEC_TOKENS}
    request = {"policy": str(exports.policy), "prompts": prompts, "max_tokens": NEW_TOKENS, "configs": configs}
    return run_helper(python, "vllm_greedy.py", request, tmp_path_factory.mktemp("vllm"), "VLLM_GREEDY")


def test_exported_drafters_have_the_forms_vllm_loads(exports: Exports) -> None:
    e3 = json.loads((exports.drafters["eagle3"] / "config.json").read_text())
    assert e3["architectures"] == ["LlamaForCausalLMEagle3"]
    # the default full vocabulary: no d2t/t2d, which vLLM would fail on
    assert e3["draft_vocab_size"] == e3["vocab_size"] == 49152
    e1 = json.loads((exports.drafters["eagle"] / "config.json").read_text())
    assert e1["architectures"][0] == "LlamaForCausalLMEagle"


def test_vllm_serves_the_policy_as_transformers_does(exports: Exports, prompts: list[list[int]], served: dict) -> None:
    hf = AutoModelForCausalLM.from_pretrained(exports.policy, dtype=torch.float32).eval()
    for ids, got in zip(prompts, served["plain"]["tokens"], strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS)  # vLLM runs with ignore_eos: as many tokens
        assert got == out[0, len(ids):].tolist()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_speculative_decoding_with_our_drafter_is_lossless(served: dict, method: str) -> None:
    assert served[method]["tokens"] == served["plain"]["tokens"]
    spec = served[method]["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] == SPEC_TOKENS * spec["drafts"]
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    rate = spec["accepted_tokens"] / spec["draft_tokens"]
    mean_len = 1 + spec["accepted_tokens"] / spec["drafts"]
    assert 0.0 <= rate <= 1.0 and 1.0 <= mean_len <= 1 + SPEC_TOKENS
    print(f"vLLM {method}: {spec['drafts']} drafts of {SPEC_TOKENS}, {spec['accepted_tokens']} accepted: "
          f"acceptance rate {rate:.3f}, mean acceptance length {mean_len:.2f}")
    out = REPO / "test-artifacts" / "vllm-acceptance.json"
    out.parent.mkdir(exist_ok=True)
    record = json.loads(out.read_text()) if out.exists() else {}
    record[method] = {**spec, "acceptance_rate": rate, "mean_acceptance_length": mean_len}
    out.write_text(json.dumps(record, indent=2) + "\n")
