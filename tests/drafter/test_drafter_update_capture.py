"""The drafter's training rows taken from the policy update's forward (rl/policy_forward.py `capture`,
rollout_vllm/drafter.py `UpdateRows`), as the vLLM rollout backend trains its drafter: for each sequence of a padded
micro-batch, the prompt's last position and every fed response token, with the target hidden rows our engine's hook
gives there (EAGLE-3: the three feature layers' inputs, then the final hidden), each sequence's rows in order under
its own id; the logits the update trains on are unchanged by the capture. No vLLM needed.

Run: python -m pytest tests/drafter/test_drafter_update_capture.py -q
"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.job_spec_translate import drafter_config
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.batch import UpdateSeq, pack
from worker.tlt.rl.policy_forward import ResponseLogits
from worker.tlt.rollout.decode_step import hook_rows
from worker.tlt.rollout_vllm.drafter import UpdateRows
from worker.tlt.speculative.drafter.online import OnlineDrafter


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_update_forward_rows_are_the_engines_hook_rows(kind: str, tiny_target: Transformer) -> None:
    spec = JobSpec.model_validate({"model": {"builtin": "tiny-llama"}, "rollout": {"backend": "vllm"},
                                   "drafter": {"kind": kind, "buffer_gb": 0.01}})
    od = OnlineDrafter(drafter_config(spec), tiny_target)
    od.begin_rollout(1)
    rows = UpdateRows(od)
    seqs = [UpdateSeq([5, 6, 7, 8], [9, 10, 11], 1.0, None), UpdateSeq([12, 13], [14, 15, 16, 17, 18], -1.0, None)]
    mb = pack(seqs, pad_id=0, device="cpu")
    b, s = mb.input_ids.shape
    at = mb.resp_index + mb.resp_index // (s - 1)
    with torch.no_grad():
        plain = ResponseLogits(tiny_target)(mb.input_ids, at)
        got = ResponseLogits(tiny_target, capture=rows)(mb.input_ids, at)
    assert torch.equal(got, plain)

    buf = od.buffer
    live = (buf.step >= 0).nonzero().squeeze(1)
    assert rows.rows == live.numel() == sum(len(x.response_ids) for x in seqs)
    for i, x in enumerate(seqs):
        ids = list(x.prompt_ids) + list(x.response_ids)
        mine = live[buf.seq[live] == i]  # the sequence's rows, in the order written
        fed = ids[len(x.prompt_ids) - 1: -1]  # the prompt's last token, then each response token but the last
        assert buf.tokens[mine].tolist() == fed
        with torch.no_grad():  # the sequence alone, unpadded: what our engine's hook computes there
            _, h, feats = tiny_target.forward_hidden(torch.tensor([ids]), compute_logits=False,
                                                     layers=od.capture_layers)
        want = hook_rows(h[0], {k: v[0] for k, v in feats.items()}, od.capture_layers)[len(x.prompt_ids) - 1: -1]
        torch.testing.assert_close(buf.hidden[mine].float(), want.float(), atol=1e-5, rtol=1e-5)
