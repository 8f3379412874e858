"""`build_model(args, state_dict, device, dtype)`: a Transformer built on the meta device and assign-loaded from an
HF-named (or fused) state dict; what every loader ends with (model/load.py, model/widen.py).
"""

from __future__ import annotations

import torch

from worker.tlt.model.args import ModelArgs
from worker.tlt.model.transformer import Transformer


def build_model(args: ModelArgs, state_dict: dict[str, torch.Tensor], device: torch.device | str,
                dtype: torch.dtype) -> Transformer:
    """Meta-device build + assign-load of an HF-named (or our fused) state dict; tied checkpoints may carry a redundant
    lm_head.weight (dropped)."""
    with torch.device("meta"):
        model = Transformer(args)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.init_rope(device)
    return model.eval()
