"""Widened targets: SmolLM2-135M-Instruct embedded exactly in a larger architecture, so real acceptance lengths meet
real step costs (`smollm2-135m-instruct@qwen2.5-7b` computes SmolLM2's function with qwen2.5-7b's tensor shapes).

    model, tok = load_widened("smollm2-135m-instruct@qwen2.5-7b", "cuda", torch.bfloat16)   # built on the device

How the function is kept (x = SmolLM2, w = the wide target):
- hidden dims 0..H_x-1 carry SmolLM2's residual stream, the rest stay zero (embedding, o_proj / down_proj rows);
- RMSNorm over H_w sees the same sum of squares divided by H_w instead of H_x: weights scaled by sqrt(H_x / H_w)
  and eps by H_x / H_w give exactly SmolLM2's normalised output;
- SmolLM2's query heads sit in the first heads of each GQA group (q head c*G_w + r for SmolLM2's c*G_x + r), its KV
  heads in the first KV heads; extra query heads have zero q and o weights, extra KV heads are zero;
- each head's dims keep their RoPE frequency: SmolLM2's pair i (dims i, i + D_x/2) sits at the wide pair j whose
  inverse frequency equals its own (dims j, j + D_w/2); q is scaled by sqrt(D_w / D_x) because SDPA's softmax scale is
  1/sqrt(D_w). Where the target's rope_theta cannot reproduce SmolLM2's frequencies (qwen2.5-7b: 1e6, llama3: 5e5),
  the widened shape keeps SmolLM2's theta (1e5) and no rope scaling (`describe()` says so); RoPE costs the same;
- MLP units 0..I_x-1 are SmolLM2's, the rest have zero gate/up/down weights;
- a target with more layers than SmolLM2's 30 gets exact identity layers at the end (all weights zero, so
  o_proj / down_proj add nothing); one with fewer (qwen2.5-7b: 28) gets 30 layers (`describe()` says so).
The step cost is the wide architecture's: memory-bound decode reads every weight whatever its value.

Run the tests: `python -m pytest tests/engine/test_widen.py -q`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from worker.tlt.model.args import ModelArgs, RopeScaling, preset, shape
from worker.tlt.model.tokenizer import Tokenizer
from worker.tlt.model.transformer import Transformer, rope_inv_freq

SMALL_BUILTIN = "smollm2-135m-instruct"

# Wide targets by name. "test" is small enough for CPU tests yet exercises every mapping: more hidden dims, a wider
# head (q rescale, RoPE placement, theta fallback), an extra KV head, extra query heads per group, extra MLP units,
# one identity layer, q/k/v biases and an untied head.
WIDEN_TARGETS: dict[str, ModelArgs] = {
    "qwen2.5-7b": shape("qwen2.5-7b"),
    "llama3-8b": shape("llama3-8b"),
    "llama3.2-3b": shape("llama3.2-3b"),
    "test": ModelArgs(
        arch="qwen2", vocab_size=49152, dim=640, n_layers=31, n_heads=16, n_kv_heads=4, head_dim=128,
        intermediate_size=1600, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=8192, tie_word_embeddings=False,
        qkv_bias=True,
    ),
}
WIDENED_BUILTINS = tuple(f"{SMALL_BUILTIN}@{t}" for t in WIDEN_TARGETS)


@dataclass(frozen=True)
class Widening:
    """Where each part of the small model sits in the wide one."""

    args: ModelArgs  # the widened model's shape
    small: ModelArgs
    target: str  # target architecture name
    q_heads: tuple[int, ...]  # wide query head of each small query head
    kv_heads: tuple[int, ...]  # wide KV head of each small KV head
    head_dims: tuple[int, ...]  # wide in-head dim of each small in-head dim (RoPE pairs keep their frequency)
    theta_kept: bool  # True: the target's rope_theta could not reproduce the small frequencies; the small one is used
    target_layers: int  # the target architecture's own layer count
    target_rope_scaled: bool = False  # the target scales RoPE (dropped with its theta when theta_kept)

    def describe(self) -> str:
        notes = []
        if self.args.n_layers != self.target_layers:
            notes.append(f"{self.args.n_layers} layers (target has {self.target_layers})")
        if self.theta_kept:
            scaling = ", no rope scaling" if self.target_rope_scaled else ""
            notes.append(f"rope theta {self.args.rope_theta:g} kept from SmolLM2{scaling}")
        tail = f" ({'; '.join(notes)})" if notes else ""
        return f"SmolLM2-135M-Instruct widened to {self.target}{tail}"


def _pair_positions(small: ModelArgs, wide: ModelArgs) -> tuple[int, ...] | None:
    """Wide RoPE pair whose inverse frequency equals each small pair's, or None if some pair has no equal."""
    inv_x, inv_w = rope_inv_freq(small), rope_inv_freq(wide)
    out = []
    for f in inv_x.tolist():
        hits = torch.nonzero(torch.isclose(inv_w, torch.tensor(f), rtol=1e-6, atol=0.0)).flatten().tolist()
        if not hits:
            return None
        out.append(hits[0])
    return tuple(out) if len(set(out)) == len(out) else None


def plan(target: str, small: ModelArgs | None = None) -> Widening:
    """The widened shape and the placement of `small` (default SmolLM2-135M) in target architecture `target`."""
    if target not in WIDEN_TARGETS:
        raise KeyError(f"unknown widening target {target!r}; known: {', '.join(WIDEN_TARGETS)}")
    return plan_into(WIDEN_TARGETS[target], target, small or preset("smollm2-135m"))


def plan_into(w: ModelArgs, target: str, x: ModelArgs) -> Widening:
    """`plan` for any target shape `w` (named `target` in descriptions)."""
    if w.arch not in ("llama", "qwen2") or x.arch != "llama" or x.qkv_bias:
        raise ValueError("widening embeds a Llama model without biases into a Llama or Qwen2 architecture")
    gx, gw = x.n_heads // x.n_kv_heads, w.n_heads // w.n_kv_heads
    fits = (w.vocab_size == x.vocab_size and w.dim >= x.dim and w.hd >= x.hd and w.n_kv_heads >= x.n_kv_heads
            and gw >= gx and w.intermediate_size >= x.intermediate_size)
    if not fits:
        raise ValueError(f"{target} cannot hold the small model (vocab, hidden, head dim, KV heads, group, MLP)")
    wide = replace(w, n_layers=max(w.n_layers, x.n_layers), norm_eps=x.norm_eps * x.dim / w.dim,
                   max_seq_len=x.max_seq_len, bos_token_id=x.bos_token_id, eos_token_ids=x.eos_token_ids)
    pairs, theta_kept = _pair_positions(x, wide), False
    if pairs is None:
        wide, theta_kept = replace(wide, rope_theta=x.rope_theta, rope_scaling=RopeScaling()), True
        pairs = _pair_positions(x, wide)
        if pairs is None:
            raise ValueError(f"{target}: head dim {w.hd} cannot carry the small model's RoPE frequencies")
    half_x, half_w = x.hd // 2, w.hd // 2
    head_dims = tuple(side * half_w + pairs[i] for side in (0, 1) for i in range(half_x))
    q_heads = tuple((h // gx) * gw + h % gx for h in range(x.n_heads))
    return Widening(wide, x, target, q_heads, tuple(range(x.n_kv_heads)), head_dims, theta_kept, w.n_layers,
                    w.rope_scaling.kind != "none")


def _rows(heads: tuple[int, ...], head_dims: tuple[int, ...], hd: int) -> torch.Tensor:
    """Wide projection rows of every (small head, small in-head dim), in the small model's row order."""
    return torch.tensor([h * hd + d for h in heads for d in head_dims])


@torch.no_grad()
def widen_state_dict(wd: Widening, small_sd: dict[str, torch.Tensor], device: torch.device | str,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our (fused) state dict of the widened model, built on `device` from the small model's HF-named fp32 one."""
    x, w = wd.small, wd.args
    hx, hw, ix, iw = x.dim, w.dim, x.intermediate_size, w.intermediate_size
    nq, nkv, dw = w.n_heads, w.n_kv_heads, w.hd
    norm_scale, q_scale = math.sqrt(hx / hw), math.sqrt(dw / x.hd)
    q_rows = _rows(wd.q_heads, wd.head_dims, dw).to(device)
    kv_rows = _rows(wd.kv_heads, wd.head_dims, dw).to(device)

    def small(name: str, scale: float = 1.0) -> torch.Tensor:
        return (small_sd[name].float() * scale).to(device=device, dtype=dtype)

    def zeros(*shape_: int) -> torch.Tensor:
        return torch.zeros(shape_, device=device, dtype=dtype)

    def norm(name: str) -> torch.Tensor:
        t = zeros(hw)
        t[:hx] = small(name, norm_scale)
        return t

    emb = zeros(w.vocab_size, hw)
    emb[:, :hx] = small("model.embed_tokens.weight")
    sd = {"model.embed_tokens.weight": emb, "model.norm.weight": norm("model.norm.weight")}
    if not w.tie_word_embeddings:
        head = small_sd.get("lm_head.weight", small_sd["model.embed_tokens.weight"])
        sd["lm_head.weight"] = zeros(w.vocab_size, hw)
        sd["lm_head.weight"][:, :hx] = head.float().to(device=device, dtype=dtype)
    for i in range(w.n_layers):
        p, real = f"model.layers.{i}.", i < x.n_layers
        qkv = zeros((nq + 2 * nkv) * dw, hw)  # rows q | k | v
        o, gate_up, down = zeros(hw, nq * dw), zeros(2 * iw, hw), zeros(hw, iw)
        ln1, ln2 = zeros(hw), zeros(hw)
        if real:
            a = p + "self_attn."
            qkv[q_rows, :hx] = small(a + "q_proj.weight", q_scale)
            qkv[nq * dw + kv_rows, :hx] = small(a + "k_proj.weight")
            qkv[(nq + nkv) * dw + kv_rows, :hx] = small(a + "v_proj.weight")
            o[:hx, q_rows] = small(a + "o_proj.weight")
            gate_up[:ix, :hx] = small(p + "mlp.gate_proj.weight")
            gate_up[iw:iw + ix, :hx] = small(p + "mlp.up_proj.weight")
            down[:hx, :ix] = small(p + "mlp.down_proj.weight")
            ln1, ln2 = norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")
        sd |= {p + "self_attn.qkv_proj.weight": qkv, p + "self_attn.o_proj.weight": o,
               p + "mlp.gate_up_proj.weight": gate_up, p + "mlp.down_proj.weight": down,
               p + "input_layernorm.weight": ln1, p + "post_attention_layernorm.weight": ln2}
        if w.qkv_bias:
            sd[p + "self_attn.qkv_proj.bias"] = zeros((nq + 2 * nkv) * dw)
    return sd


def parse_name(name: str) -> str:
    """The target of a widened builtin name (`smollm2-135m-instruct@qwen2.5-7b` -> `qwen2.5-7b`)."""
    base, _, target = name.partition("@")
    if base != SMALL_BUILTIN or target not in WIDEN_TARGETS:
        raise KeyError(f"unknown widened model {name!r}; known: {', '.join(WIDENED_BUILTINS)}")
    return target


def load_widened(name: str, device: torch.device | str, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    """The widened model built on `device` from SmolLM2's GGUF weights (no file written), and SmolLM2's tokenizer."""
    from worker.tlt.model.build_model import build_model
    from worker.tlt.model.gguf import gguf_checkpoint, smollm2_gguf_path

    small_args, state_dict, tokenizer = gguf_checkpoint(smollm2_gguf_path())
    wd = plan(parse_name(name), small_args)
    return build_model(wd.args, widen_state_dict(wd, state_dict, device, dtype), device, dtype), tokenizer
