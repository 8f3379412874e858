"""`EngineConfig.capture_layers`: with a hook attached, every forward that puts K/V into the cache (prefill, plain
decode, verify) hands the hook cat(hidden entering each captured layer, final-norm hidden) [N, (k+1)H], and those
rows equal what one plain forward of the finished sequence computes at the same positions.
Run: python -m pytest tests/engine/test_engine_capture_layers.py -q"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from worker.tlt.model import preset, random_model
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

TARGET = random_model(preset("tiny-llama", n_layers=4), seed=1, std=0.15)
LAYERS = (2, 2, 1)  # eagle3_layers(4): a repeated layer must come back twice, in this order
H = TARGET.args.dim


def _hooked_run(arm: Arm | None) -> tuple[list[list[int]], dict[tuple[int, int], list[torch.Tensor]]]:
    rows: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    fed: dict[tuple[int, int], list[int]] = defaultdict(list)

    def hook(seq_ids: list[tuple[int, int]], tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        assert hidden.shape == (len(seq_ids), (len(LAYERS) + 1) * H)
        for sid, t, h in zip(seq_ids, tokens.tolist(), hidden, strict=True):
            fed[sid].append(t)
            rows[sid].append(h.clone())

    eng = Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=3, sync_every=2,
                                                             capture_layers=LAYERS),
                 controller=AdaptiveSd.fixed(arm) if arm is not None else None,
                 proposers={"small": SmallModelProposer(perturbed_copy(TARGET, noise=0.1))}, hidden_hook=hook)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
    out = eng.generate([Request(p, RequestSampling(temperature=0.0, max_new_tokens=12)) for p in prompts])
    seqs = [prompts[s.request] + s.tokens for s in out.sequences]
    for s in out.sequences:  # each position's K/V entered the cache once, in order: all but the last token
        assert fed[(s.request, 0)] == seqs[s.request][:-1]
    return seqs, rows


@pytest.mark.parametrize("arm", [None, chain_arm("small", 3), tree_arm("small", 3, 2, 6)],
                         ids=["plain", "chain", "tree"])
def test_hook_rows_are_the_layer_inputs_of_a_plain_forward(arm: Arm | None) -> None:
    seqs, rows = _hooked_run(arm)
    for r, seq in enumerate(seqs):
        got = torch.stack(rows[(r, 0)])  # [N, 4H]
        with torch.no_grad():
            _, final, cap = TARGET.forward_hidden(torch.tensor([seq[:-1]]), layers=LAYERS)
        want = torch.cat([cap[i][0] for i in LAYERS] + [final[0]], dim=-1)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got[:, :H], got[:, 2 * H: 3 * H])  # layer 2 and layer 1 inputs really differ


def test_without_capture_layers_the_hook_gets_the_final_hidden() -> None:
    widths: set[int] = set()
    eng = Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=32, max_slots=2),
                 hidden_hook=lambda s, t, h: widths.add(h.shape[-1]))
    eng.generate([Request([1, 2, 3], RequestSampling(temperature=0.0, max_new_tokens=4))])
    assert widths == {H}


def test_capture_layers_outside_the_model_are_refused() -> None:
    with pytest.raises(ValueError, match="capture_layers"):
        Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=32, max_slots=2, capture_layers=(1, 4)))
