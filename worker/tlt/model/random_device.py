"""Random weights at a named architecture, built directly on the target device: `random_on_device(args, "cuda")`.

For speed measurements at real sizes (`tlt bench decode --model shape:qwen2.5-7b`): a 7B model is 15 GB in bf16, so
it is allocated once in the target dtype on the device (meta build, `to_empty`) and filled there, with no download and
no host copy. Speed does not depend on the values; matrices are normal(0, std), norms ones, biases normal(0, std),
the same law as `model.load.random_model` (which draws per HF tensor on the host, for seed-stable test models).
"""

from __future__ import annotations

import torch

from worker.tlt.model.args import ModelArgs
from worker.tlt.model.transformer import Transformer


@torch.no_grad()
def random_on_device(args: ModelArgs, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     std: float = 0.02, max_seq_len: int | None = None) -> Transformer:
    """A model of shape `args` with random weights in `dtype` on `device`; RoPE tables for `max_seq_len` positions
    (default args.max_seq_len: 131,072 rows for Llama 3.2 is 128 MB, so a benchmark passes what it needs)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    model.init_rope(device, max_seq_len)
    return model.eval()
