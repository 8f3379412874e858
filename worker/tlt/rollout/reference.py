"""Reference pieces for checking the engine (used by `tlt selfcheck` and tests/engine): a naive full-recompute
greedy decoder, a drafter that agrees with its target only partly, random ragged prompts, a peaked tiny model."""

from __future__ import annotations

import torch

from worker.tlt.model.args import preset
from worker.tlt.model.load import build_model, random_model
from worker.tlt.model.transformer import Transformer


def tiny_target(arch: str = "tiny-llama", seed: int = 1, **overrides: object) -> Transformer:
    """A tiny random model whose continuations are peaked and varied (std 0.1; 0.02 is nearly uniform)."""
    return random_model(preset(arch, **overrides), seed=seed, std=0.1)


def perturbed_copy(model: Transformer, noise: float, seed: int = 7) -> Transformer:
    """`model` with Gaussian noise (relative to each matrix's std) on every matrix: a drafter that agrees with it
    often but not always, so partial acceptance and KV roll-back get exercised."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        sd[k] = v + noise * torch.randn(v.shape, generator=g) * v.std() if v.dim() > 1 else v.clone()
    w = model.head_weight
    return build_model(model.args, sd, w.device, w.dtype)


@torch.no_grad()
def naive_greedy(model: Transformer, prompt: list[int], max_new: int, eos: tuple[int, ...]) -> list[int]:
    """Greedy decoding by full recompute of the whole sequence for every token."""
    dev = model.head_weight.device
    ids, out = list(prompt), []
    for _ in range(max_new):
        t = int(model(torch.tensor([ids], device=dev))[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t in eos:
            break
    return out


def random_prompts(n: int, seed: int, lo: int = 2, hi: int = 24, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]
