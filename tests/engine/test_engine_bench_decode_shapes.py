"""`tlt bench decode` at named shapes: the CLI runs end to end on CPU (tiny preset as `shape:`), reports the roofline
fields and the verify cost, applies its kernel switches only for the run, and refuses bad input with a usage error;
the roofline counts exactly the bytes of the weights a step reads; random weights are built in place on the device.
Run: python -m pytest tests/engine/test_engine_bench_decode_shapes.py -q"""

from __future__ import annotations

import json

import pytest
import torch

from worker.cli import main as tlt
from worker.tlt.kernels.settings import current
from worker.tlt.model.args import SHAPES, preset
from worker.tlt.model.random_device import random_on_device
from worker.tlt.model.roofline import datasheet_bandwidth, kv_bytes, roofline_tokens_per_s, weight_bytes
from worker.tlt.model.transformer import Transformer


def test_bench_decode_shape_json(capsys: pytest.CaptureFixture[str]) -> None:
    before = current()
    argv = ["bench", "decode", "--model", "shape:tiny-qwen3", "--device", "cpu", "--dtype", "float32", "--batch", "1,3",
            "--max-new-tokens", "4", "--prompt-len", "5", "--verify", "--no-pdl", "--json"]
    assert tlt(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["roofline_tokens_per_s"] > 0
        assert r["pct_roofline"] == pytest.approx(100 * r["tokens_per_s"] / r["roofline_tokens_per_s"])
    assert [v["batch"] for v in res["verify"]] == [1, 2, 4, 8]
    assert all(v["verify_over_step"] == pytest.approx(v["forward_8_us"] / v["forward_1_us"]) for v in res["verify"])
    assert res["kernels"]["pdl"] is False and current() == before  # the switch held for the run only


@pytest.mark.parametrize("bad", [["--model", "shape:gpt-9"], ["--batch", "0"], ["--batch", "1,x"],
                                 ["--max-new-tokens", "0"]])
def test_bench_decode_refuses_bad_input(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        tlt(["bench", "decode", "--device", "cpu", *bad])
    assert e.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama3-8b", "qwen3-8b", "qwen2.5-1.5b"])
def test_weight_bytes_are_the_parameters_a_step_reads(name: str) -> None:
    args = SHAPES[name]
    with torch.device("meta"):
        model = Transformer(args)
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    read = params if args.tie_word_embeddings else params - embed  # a tied table is read whole by the head
    assert weight_bytes(args, dtype_bytes=2) == 2 * read
    assert kv_bytes(args, batch=2, context=10) == 2 * 2 * 10 * args.n_layers * 2 * args.n_kv_heads * args.hd


def test_roofline_of_qwen_7b_on_an_h200() -> None:
    bw = datasheet_bandwidth("NVIDIA H200")
    assert bw == 4.8e12 and datasheet_bandwidth("Some GPU") is None
    assert datasheet_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    roof = roofline_tokens_per_s(SHAPES["qwen2.5-7b"], batch=1, context=192, bandwidth=bw)
    assert 355 < roof < 360  # 13.4 GB of weights per token at 4.8 TB/s: the "HBM limit" row


def test_random_on_device_builds_in_dtype() -> None:
    args = preset("tiny-qwen2")
    model = random_on_device(args, "cpu", dtype=torch.bfloat16, seed=3, max_seq_len=64)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.shape == (64, args.hd)
    params = dict(model.named_parameters())
    norm = params["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    w = params["model.layers.0.mlp.down_proj.weight"].float()
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.005
    again = dict(random_on_device(args, "cpu", dtype=torch.bfloat16, seed=3, max_seq_len=64).named_parameters())
    assert torch.equal(again["model.layers.0.mlp.down_proj.weight"], params["model.layers.0.mlp.down_proj.weight"])
