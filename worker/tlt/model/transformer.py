"""Decoder-only transformer for the Llama / Qwen2 / Qwen3 families: one implementation for training and inference.

Parameter names mirror HF transformers (`model.embed_tokens`, `model.layers.{i}.self_attn.o_proj`, ..., `lm_head`)
except for two fused projections per layer: `self_attn.qkv_proj` (rows q | k | v) and `mlp.gate_up_proj` (rows
gate | up), fewer and larger GEMMs for the launch-bound decode step (model/hf_names.py maps the names;
`load_state_dict` takes HF names as well, exports write HF names). Build on the meta device and load with
`load_state_dict(sd, assign=True)`, then call `init_rope(device)` (see `model/load.py`).

Calls:
  model(input_ids)                          # [B, S] -> logits [B, S, V]; plain causal, autograd (the trainer's call)
  model.forward(input_ids, positions=..., cache=..., cache_rows=..., write_idx=..., attn_mask=..., logits_at=...)
                                            # the engine's call: K/V written into `cache` rows, attention by mask
  model.forward_hidden(..., layers=(2, 15, 27))
                                            # -> (logits, final-norm hidden [B, S, H], {i: hidden entering layer i})
                                            # from the same single forward (EAGLE-1 uses the 2nd, EAGLE-3 the 3rd)
Set `model.gradient_checkpointing = True` to recompute each layer in backward (training path only).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from worker.tlt.model.args import ModelArgs
from worker.tlt.model.hf_names import accept_hf_names

# SDPA backends, cuDNN's left out: on an H200 it built an execution plan on the host for every new shape (~5 ms per
# forward and ~7 ms per backward call of each layer), so the update of varying-length micro-batches was host-bound
# (bench/train_bench.py --profile-update: GPU busy 0.28 s of a 1.0 s update). Flash / memory-efficient attention have
# no per-shape plan.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class LayerCache(Protocol):
    """What the model needs from a KV cache (decoding/kv_cache.py): per layer, K and V pages [n_pages, Hkv, P, D],
    and the block table [slots, pages_per_row] int32 that puts a row's column c at (table[row, c // P], c % P);
    `paged` False: the row layout (P = the row's length, identity table: a row is read as a view)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_table: torch.Tensor
    paged: bool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        # As HF: normalise in fp32, round to the input dtype, then scale. F.rms_norm without a weight does the first
        # two itself (fp32 opmath, output in the input dtype; one fused kernel on CUDA), so no cast kernels around it.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [D/2] with the checkpoint's scaling applied (HF's `_compute_*_parameters`)."""
    d = args.hd
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = args.rope_scaling
    if rs.kind == "linear":
        inv = inv / rs.factor
    elif rs.kind == "llama3":
        low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's half-split layout) in three kernels and for any strides of x (the q and k
    heads of the fused projection in one pass): with sin_signed = cat(-sin[:D/2], sin[D/2:]), the first half of the
    output gains x[D/2:] * sin_signed[:D/2] and the second half x[:D/2] * sin_signed[D/2:]."""
    # x [B, S, Hq + Hkv, D] (any strides); cos, sin_signed [B, S, 1, D]
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin_signed[..., :half])
    out[..., half:].addcmul_(x[..., :half], sin_signed[..., half:])
    return out


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int | None = None) -> None:  # in_dim: input width (default H)
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.hd
        self.qkv_proj = nn.Linear(in_dim or args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.hd,
                                  bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.hd, args.dim, bias=False)
        self.q_norm = RMSNorm(args.hd, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.hd, args.norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        cos: torch.Tensor,  # [B, S, 1, D]
        sin: torch.Tensor,  # [B, S, 1, D] sign-folded (see apply_rope)
        kv: tuple[torch.Tensor, torch.Tensor] | None,  # K, V pages of this layer, each [n_pages, Hkv, P, D]
        write_at: tuple[torch.Tensor, torch.Tensor] | None,  # page [B, S] and offset [B, S] of each new K/V
        mask: torch.Tensor | None,  # [B, 1, G*S, Tk] additive (0 = attend, -inf = not) (None: plain causal)
        rows: slice | torch.Tensor,  # row layout: the cache rows of this batch; paged: their pages [B, n] to read
    ) -> torch.Tensor:  # [B, S, H]
        b, s, _ = x.shape
        nq, nkv, d = self.n_heads, self.n_kv, self.hd
        qkv = self.qkv_proj(x).view(b, s, nq + 2 * nkv, d)  # [B, S, Hq + 2 Hkv, D]
        qk, v = qkv.split((nq + nkv, nkv), dim=2)  # views
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :nq]), self.k_norm(qk[:, :, nq:])), dim=2)
        qk = apply_rope(qk, cos, sin)  # q and k heads in one pass
        q_bshd, k_bshd = qk.split((nq, nkv), dim=2)  # [B, S, Hq | Hkv, D] views
        q, k, v_bhsd = q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D] views
        g = nq // nkv
        if kv is None:
            if g > 1:
                k, v_bhsd = k.repeat_interleave(g, dim=1), v_bhsd.repeat_interleave(g, dim=1)
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v_bhsd, is_causal=s > 1)
        else:
            assert write_at is not None and mask is not None
            ck, cv = kv
            # cache[page, :, offset] = K/V [B, S, Hkv, D]: one indexed write from any strides (index_copy_ would
            # need a contiguous copy of the fused projection's slices first)
            ck[write_at[0], :, write_at[1]] = k_bshd.to(ck.dtype)
            cv[write_at[0], :, write_at[1]] = v.to(cv.dtype)
            tk = mask.shape[-1]
            if isinstance(rows, slice):  # the row layout: [B, Hkv, Tk, D] views, no copy
                keys, vals = ck[rows, :, :tk], cv[rows, :, :tk]
            else:  # paged: the rows' pages gathered into [B, Hkv, n * P, D] (the fused kernels read them in place)
                keys, vals = (_gather_pages(t, rows)[:, :, :tk] for t in (ck, cv))
            # GQA without copying the cache: fold the G query heads of each KV head into the query length.
            qg = q.reshape(b, nkv, g * s, d)
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask).reshape(b, nq, s, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, nq * d))


def _gather_pages(t: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:  # [n_pages, Hkv, P, D], [B, n]
    b, n = pages.shape
    _, hkv, p, d = t.shape
    return t[pages].transpose(1, 2).reshape(b, hkv, n * p, d)  # [B, Hkv, n * P, D]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # rows gate | up
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, S, I] views
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        cos: torch.Tensor,  # [B, S, 1, D]
        sin: torch.Tensor,  # [B, S, 1, D]
        kv: tuple[torch.Tensor, torch.Tensor] | None,
        write_at: tuple[torch.Tensor, torch.Tensor] | None,  # cache row [B, 1], column [B, S]
        mask: torch.Tensor | None,  # [B, 1, G*S, Tk]
        rows: slice | torch.Tensor,
    ) -> torch.Tensor:  # [B, S, H]
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, write_at, mask, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Body(nn.Module):
    """Holds the `model.*` parameters."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = _Body(args)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        accept_hf_names(self)

    def init_rope(self, device: torch.device | str | None = None, max_seq_len: int | None = None) -> None:
        """(Re)compute the RoPE tables [T, D] in fp32 on `device` (needed after building on meta)."""
        device = device if device is not None else self.model.norm.weight.device
        n = max_seq_len or self.args.max_seq_len
        inv = rope_inv_freq(self.args).to(device)
        t = torch.arange(n, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.rope_cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        self.rope_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # sign-folded for apply_rope

    @property
    def head_weight(self) -> torch.Tensor:  # [V, H]
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] final-norm hidden -> [..., V]
        return F.linear(h, self.head_weight)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor | None = None,  # [B, S] RoPE positions; None = 0..S-1
        cache: LayerCache | None = None,  # None = plain causal attention over input_ids only
        *,
        cache_rows: slice | None = None,  # cache rows of this batch (default 0..B-1)
        write_idx: torch.Tensor | None = None,  # [B, S] cache column of each token's K/V (default = positions)
        attn_mask: torch.Tensor | None = None,  # [B, S, Tk] bool over cache columns 0..Tk-1; needed with a cache
        logits_at: torch.Tensor | None = None,  # [B, K] positions (in 0..S-1) to compute logits for; None = all
    ) -> torch.Tensor:  # [B, S or K, V]
        return self.forward_hidden(
            input_ids, positions, cache, cache_rows=cache_rows, write_idx=write_idx, attn_mask=attn_mask,
            logits_at=logits_at,
        )[0]

    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor | None = None,  # [B, S]
        cache: LayerCache | None = None,
        *,
        cache_rows: slice | None = None,
        write_idx: torch.Tensor | None = None,  # [B, S]
        attn_mask: torch.Tensor | None = None,  # [B, S, Tk]
        logits_at: torch.Tensor | None = None,  # [B, K]
        layers: tuple[int, ...] = (),  # also return the hidden states entering these layers (HF hidden_states[i])
        compute_logits: bool = True,  # False: skip lm_head (logits returned empty)
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One forward; returns (logits, final-norm hidden [B, S, H], {layer i: hidden entering layer i [B, S, H]})."""
        b, s = input_ids.shape
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        cos = self.rope_cos[positions].unsqueeze(2)  # [B, S, 1, D]
        sin = self.rope_sin[positions].unsqueeze(2)
        x = self.model.embed_tokens(input_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rows: slice | torch.Tensor = cache_rows if cache_rows is not None else slice(0, b)
        write_at, mask = None, None
        if cache is not None:
            if attn_mask is None:
                raise ValueError("a cached forward needs attn_mask [B, S, Tk]")
            hkv = self.args.n_kv_heads
            assert isinstance(rows, slice)
            row_ids = torch.arange(rows.start or 0, (rows.start or 0) + b, device=input_ids.device)
            cols = positions if write_idx is None else write_idx  # [B, S]
            p, table = cache.k[0].shape[2], cache.block_table
            write_at = (table[row_ids[:, None], cols // p].long(), cols % p)  # page, offset [B, S]
            g = self.args.n_heads // hkv
            tk = attn_mask.shape[-1]
            if cache.paged:
                rows = table[row_ids, : -(-tk // p)].long()  # [B, n] the pages holding columns 0..Tk-1
            # additive mask built once per forward (SDPA would convert a bool mask in every layer)
            mask = torch.full(attn_mask.shape, float("-inf"), dtype=x.dtype, device=x.device).masked_fill_(attn_mask, 0.0)
            mask = mask[:, None, None].expand(b, 1, g, s, tk).reshape(b, 1, g * s, tk)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in layers:
                captured[i] = x
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            if self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, None, None, None, rows, use_reentrant=False)
            else:
                x = layer(x, cos, sin, kv, write_at, mask, rows)
        h = self.model.norm(x)
        if not compute_logits:
            return h.new_empty(0), h, captured
        hl = h if logits_at is None else h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))
        return self.logits_from_hidden(hl), h, captured
