"""GPU check of `EngineConfig.capture_layers` (marked `gpu`: never run by CI). On an H200:
    python -m pytest tests/engine/test_engine_capture_layers_gpu.py -m gpu -q
With CUDA graphs (the decode graph's and the verify graph's static hidden outputs are [B, 4H]) and the EAGLE-3
online drafter's graphed chain draft, on a tiny fp32 4-layer model: the hook's rows equal a plain forward's layer
inputs and final hidden, and greedy SD with the EAGLE-3 drafter is token-identical to plain greedy decoding.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.job_spec_translate import drafter_config
from worker.tlt.model import preset, random_model
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.online import OnlineDrafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graphed_eagle3_capture_and_lossless_greedy() -> None:
    target = random_model(preset("tiny-llama", n_layers=4), seed=1, std=0.15, device="cuda")
    spec = JobSpec.model_validate({"model": {"builtin": "tiny-llama"},
                                   "drafter": {"kind": "eagle3", "buffer_gb": 0.01, "learning_rate": 1e-2}})
    od = OnlineDrafter(drafter_config(spec), target)
    rows: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)

    def hook(seq_ids: list[tuple[int, int]], tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        od.hidden_hook(seq_ids, tokens, hidden)
        for sid, h in zip(seq_ids, hidden, strict=True):
            rows[sid].append(h.clone())

    cfg = EngineConfig(max_len=96, max_slots=4, cuda_graphs=True, capture_layers=od.capture_layers)
    eng = Engine(target, eos_ids=(257,), config=cfg, controller=AdaptiveSd.fixed(chain_arm("eagle", 4)),
                 proposers={"eagle": od.proposer}, hidden_hook=hook)
    reqs = [Request([5, 6, 7, 8], RequestSampling(temperature=0.0, max_new_tokens=40)),
            Request([40, 41], RequestSampling(temperature=0.0, max_new_tokens=40)),
            Request([9, 10, 11, 12, 13], RequestSampling(temperature=0.0, max_new_tokens=40))]
    od.begin_rollout(0)
    od.observe_rollout(eng.generate(reqs))
    od.after_update(0, [])
    od.begin_rollout(1)  # trained weights: some drafts accepted
    rows.clear()
    sd = eng.generate(reqs)
    assert eng.verify_graphs is not None and len(eng.verify_graphs) > 0
    plain = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=4)).generate(reqs)
    assert [s.tokens for s in sd.sequences] == [s.tokens for s in plain.sequences]
    for s in sd.sequences:
        seq = reqs[s.request].prompt + s.tokens
        with torch.no_grad():
            _, final, cap = target.forward_hidden(torch.tensor([seq[:-1]], device="cuda"), layers=od.capture_layers)
        want = torch.cat([cap[i][0] for i in od.capture_layers] + [final[0]], dim=-1)
        torch.testing.assert_close(torch.stack(rows[(s.request, 0)]), want, atol=1e-3, rtol=1e-3)
