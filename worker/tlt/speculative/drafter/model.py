"""The learned drafter: `EagleDrafter`, EAGLE-1 (TLT's form) or EAGLE-3, sharing the target's embedding and head.

EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"; the layout vLLM's
`llama_eagle.py` and SGLang's `llama_eagle.py` load):
    x   = fc(concat(embed(x_{j+1}), h_j))            # [.., 2H] -> [.., H], h_j = the target's final-norm hidden
    a   = x + attn(x)                                 # layer 0 has no input_layernorm
    out = a + mlp(post_attention_layernorm(a))        # the predicted *feature* h_{j+1} (no extra norm)
    logits = target_lm_head(out)                      # frozen, shared
EAGLE-3 (Li et al. 2025; vLLM/SGLang `llama_eagle3.py`):
    x   = fc(concat(g2, g_{L//2}, g_{L-3}))  at the first step (hidden states *entering* those target layers), else
          the previous step's `out`
    a   = x + attn(concat(input_layernorm(embed(x_{j+1})), hidden_norm(x)))   # q/k/v (our fused qkv_proj) read 2H
    out = a + mlp(post_attention_layernorm(a));  logits = lm_head(norm(out))  # own head over a draft vocab (d2t)
The embedding (and, for EAGLE-1, the head) are the target's own tensors, read through `self.target` and detached,
so they are shared by identity, never copied, and get no gradient from the drafter (the policy may be training them).

A drafter position j pairs the token x_{j+1} with the target feature h_j and uses RoPE position j; the s-th
unrolled step at j (training-time test / multi-token drafting) uses position j + s. `step()` is the one primitive:
queries of S new entries attend to `past` K/V (any mask), so training (teacher forcing + EAGLE-3's diagonal
training-time-test mask), chain drafting and tree drafting all call it.

Run the tests: `python -m pytest tests/drafter -q`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.tlt.kernels import fused_available, unsupported_reason
from worker.tlt.model.args import ModelArgs
from worker.tlt.model.hf_names import FUSED, accept_hf_names, split_sizes
from worker.tlt.model.transformer import MLP, Attention, RMSNorm, Transformer, rope_inv_freq
from worker.tlt.speculative.drafter.draft_kv import DraftKV

Kind = Literal["eagle1", "eagle3"]


@dataclass(frozen=True)
class EagleConfig:
    kind: Kind = "eagle1"  # eagle1: TLT's form (target head); eagle3: three-layer features, own draft-vocab head
    draft_vocab_size: int = 0  # eagle3 only: rows of its lm_head; 0 = the target's vocab
    ttt_steps: int = 1  # unrolled training steps (EAGLE-3's training-time test); 1 = EAGLE-1 teacher forcing
    feature_noise: float = 0.0  # uniform noise half-width added to input features in training (EAGLE-1 uses 0.1)


def eagle3_layers(n_layers: int) -> tuple[int, int, int]:
    """Target layers whose *input* hidden states EAGLE-3 reads (vLLM and SGLang default: 2, L//2, L-3)."""
    if n_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with >= 4 layers (got {n_layers})")
    return (2, n_layers // 2, n_layers - 3)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., D]: HF's half-split RoPE layout
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class EagleDrafter(nn.Module):
    d2t: torch.Tensor  # [draft_vocab] int64 (EAGLE-3 buffer)
    t2d: torch.Tensor  # [V] bool (EAGLE-3 buffer)
    lm_head: nn.Linear  # EAGLE-3 only
    input_layernorm: RMSNorm  # EAGLE-3 only
    hidden_norm: RMSNorm  # EAGLE-3 only
    norm: RMSNorm  # EAGLE-3 only

    def __init__(self, target: Transformer, cfg: EagleConfig = EagleConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        targs = target.args
        # One Llama layer of the target's shape (EAGLE drafters are Llama layers also for Qwen targets).
        self.args: ModelArgs = replace(targs, arch="llama", n_layers=1, qkv_bias=False, qk_norm=False)
        self.__dict__["target"] = target  # not a submodule: its parameters are not ours (no state_dict, no optim)
        h = targs.dim
        self.feature_layers: tuple[int, ...] = ()
        if cfg.kind == "eagle1":
            self.fc = nn.Linear(2 * h, h, bias=False)
        else:
            self.feature_layers = eagle3_layers(targs.n_layers)
            self.fc = nn.Linear(3 * h, h, bias=False)
        self.self_attn = Attention(self.args, in_dim=2 * h if cfg.kind == "eagle3" else h)  # EAGLE-3: concat(embed, x)
        if cfg.kind == "eagle3":
            self.input_layernorm = RMSNorm(h, targs.norm_eps)
            self.hidden_norm = RMSNorm(h, targs.norm_eps)
            self.norm = RMSNorm(h, targs.norm_eps)
            dv = cfg.draft_vocab_size or targs.vocab_size
            self.lm_head = nn.Linear(h, dv, bias=False)
            # d2t[i] = target id of draft id i minus i (the EAGLE-3 checkpoint convention); t2d[t] = t is in the vocab
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(targs.vocab_size, dtype=torch.bool))
            self.t2d[:dv] = True
        self.post_attention_layernorm = RMSNorm(h, targs.norm_eps)
        self.mlp = MLP(self.args)
        self._inv_freq = rope_inv_freq(self.args)  # [D/2] fp32; a plain attribute so .to(dtype) never rounds it
        # EAGLE-1 steps into a preallocated K/V (write_at given; inference) on the fused Triton kernels
        # (speculative/drafter/fused_step.py): None = on CUDA where they can run, else torch; True = also off CUDA (Triton's
        # interpreter: tests), or a ValueError saying why they cannot run; False = torch.
        self.fused: bool | None = None
        self.reset_parameters()
        accept_hf_names(self)  # load_state_dict also takes the exported (HF-named, unfused) weights

    # ------------------------------------------------------------------------------------------------ setup
    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                module = name.split(".")[-2] if "." in name else ""
                rows = split_sizes(module, self.args) if module in FUSED else (p.shape[0],)
                for piece in p.split(rows):  # one draw per HF tensor (q | k | v, gate | up), as before the fusion
                    piece.copy_(torch.randn(piece.shape, generator=g) * std)
        if self.cfg.kind == "eagle1":
            # Start as "copy the target hidden": fc = [0 | I] makes step one the identity map on h_j.
            with torch.no_grad():
                h = self.args.dim
                self.fc.weight.zero_()
                self.fc.weight[:, h:] = torch.eye(h)
        else:
            self._head_from_target()

    def _head_from_target(self) -> None:
        """EAGLE-3: start the own head as the target's (final norm + its head rows of the draft vocabulary), so
        `draft_logits` of a target-like hidden state begin as the target's logits instead of noise."""
        t = self.target
        ids = self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)
        with torch.no_grad():
            head = t.head_weight.detach()
            self.lm_head.weight.copy_(head.index_select(0, ids.to(head.device)).to(self.lm_head.weight))
            self.norm.weight.copy_(t.model.norm.weight.detach().to(self.norm.weight))

    @property
    def target(self) -> Transformer:
        return self.__dict__["target"]

    def set_target(self, target: Transformer) -> None:
        """Point at a (new) target whose embedding / head the drafter shares (e.g. after a weight sync)."""
        self.__dict__["target"] = target

    @property
    def embed_weight(self) -> torch.Tensor:  # [V, H] the target's embedding, shared
        return self.target.model.embed_tokens.weight

    @property
    def feature_dim(self) -> int:
        """Width of the target features the drafter reads: H (EAGLE-1) or 3H (EAGLE-3)."""
        return self.args.dim * (1 if self.cfg.kind == "eagle1" else 3)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0]) if self.cfg.kind == "eagle3" else self.args.vocab_size

    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:  # [V] counts of each target token
        """EAGLE-3: keep the `draft_vocab_size` most frequent target tokens (sorted by id) as the draft vocabulary;
        the head restarts from the target's rows of it (call before training, as the warm-up does)."""
        assert self.cfg.kind == "eagle3"
        dv = self.draft_vocab_size
        ids = torch.sort(torch.topk(token_counts.float(), dv).indices).values.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(dv, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self._head_from_target()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a drafter checkpoint holds: its own parameters and buffers (never the shared target tensors)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    # ------------------------------------------------------------------------------------------------ math
    def features(
        self,
        final_hidden: torch.Tensor,  # [..., H] the target's final-norm hidden
        captured: dict[int, torch.Tensor],  # {layer i: hidden entering layer i [..., H]} from forward_hidden
    ) -> torch.Tensor:  # [..., F]
        """The target feature this drafter reads from one target forward (F = H or 3H)."""
        if self.cfg.kind == "eagle1":
            return final_hidden
        return torch.cat([captured[i] for i in self.feature_layers], dim=-1)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, S] -> 2x [B, 1, S, D]
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, H]
        return F.embedding(tokens, self.embed_weight.detach())

    def step(
        self,
        tokens: torch.Tensor,  # [B, S] token x_{j+1} of each new entry
        hidden: torch.Tensor,  # [B, S, F] target feature (first step) or [B, S, H] the drafter's previous `out`
        positions: torch.Tensor,  # [B, S] RoPE positions
        past: DraftKV | None,  # K/V of earlier entries, each [B, Hkv, P, D] (a preallocated buffer with write_at)
        mask: torch.Tensor | None,  # [B, S, P + S] bool, True = attend; None = causal over the new entries only
        write_at: int | None = None,  # write the new K/V into `past` at columns write_at.. and attend to
        # columns [0, write_at + S) (P = write_at): fixed shapes, no allocation of the cache
    ) -> tuple[torch.Tensor, DraftKV]:  # out [B, S, H] (pre-norm feature), K/V of past + the new entries
        if write_at is not None and past is not None and mask is not None and self.fused_step_on(tokens.device):
            from worker.tlt.speculative.drafter.fused_step import (
                fused_drafter_step,  # imports triton: only on this path
            )
            return fused_drafter_step(self, tokens, hidden, positions, past, mask, write_at)
        b, s = tokens.shape
        a = self.args
        e = self._embed(tokens).to(self.fc.weight.dtype)
        hidden = hidden.to(self.fc.weight.dtype)
        if self.cfg.kind == "eagle1":
            x = self.fc(torch.cat([e, hidden], dim=-1))
            attn_in = x
        else:
            x = self.fc(hidden) if hidden.shape[-1] != a.dim else hidden
            attn_in = torch.cat([self.input_layernorm(e), self.hidden_norm(x)], dim=-1)
        at = self.self_attn
        cos, sin = self._rope(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        qkv = at.qkv_proj(attn_in).view(b, s, a.n_heads + 2 * a.n_kv_heads, a.hd).transpose(1, 2)  # [B, Hq+2Hkv, S, D]
        qk, v = qkv.split((a.n_heads + a.n_kv_heads, a.n_kv_heads), dim=1)
        qk = qk * cos + _rotate_half(qk) * sin  # q and k heads in one pass
        q, k = qk.split((a.n_heads, a.n_kv_heads), dim=1)
        if write_at is not None:
            if past is None:
                raise ValueError("write_at needs a preallocated `past` buffer")
            past.k[:, :, write_at: write_at + s] = k
            past.v[:, :, write_at: write_at + s] = v
            kv = past
            keys, vals = kv.k[:, :, : write_at + s], kv.v[:, :, : write_at + s]
        else:
            kv = DraftKV(k, v) if past is None else past.extend(k, v)
            keys, vals = kv.k, kv.v
        g = a.n_heads // a.n_kv_heads
        if g > 1:
            keys, vals = keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1)
        if mask is None and past is None and write_at is None:
            o = F.scaled_dot_product_attention(q, keys, vals, is_causal=s > 1)
        else:
            if mask is None:
                raise ValueError("a step over past entries needs a mask [B, S, P+S]")
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask[:, None])
        h1 = x + at.o_proj(o.transpose(1, 2).reshape(b, s, a.n_heads * a.hd))
        out = h1 + self.mlp(self.post_attention_layernorm(h1))
        return out, kv

    def fused_step_on(self, device: torch.device) -> bool:
        """Whether a step with a preallocated K/V runs fused (see `fused`): EAGLE-1, no autograd, kernels runnable.
        A chain draft then samples in kernels too where its rows allow (speculative/drafter/eagle_proposer.py)."""
        if self.fused is False or self.cfg.kind != "eagle1" or torch.is_grad_enabled():
            return False
        if self.fused is None and device.type != "cuda":
            return False
        reason = fused_available(device) or unsupported_reason(self.args, self.fc.weight.dtype)
        if reason is None:
            from worker.tlt.speculative.drafter.fused_step import rope_mismatch  # imports triton

            reason = rope_mismatch(self)
        if reason is not None and self.fused:
            raise ValueError(f"EagleDrafter.fused=True but the fused step cannot run: {reason}")
        return reason is None

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V'] over the draft vocab
        if self.cfg.kind == "eagle1":
            return F.linear(out, self.target.head_weight.detach().to(out.dtype))
        return self.lm_head(self.norm(out))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:  # draft ids -> target ids (same shape)
        return ids if self.cfg.kind == "eagle1" else ids + self.d2t[ids]

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] over the target vocab
        """Drafter logits in target ids; tokens outside an EAGLE-3 draft vocab get -inf."""
        dl = self.draft_logits(out)
        if self.cfg.kind == "eagle1":
            return dl
        full = dl.new_full((*dl.shape[:-1], self.args.vocab_size), float("-inf"))
        ids = torch.arange(self.draft_vocab_size, device=dl.device)
        return full.index_copy(-1, self.draft_to_target(ids), dl)

    # ------------------------------------------------------------------------------------------------ training
    def unroll(
        self,
        tokens: torch.Tensor,  # [B, S + K - 1] tokens x_1 .. x_{S+K-1} of a window (entry j, step s reads x_{j+1+s})
        feats: torch.Tensor,  # [B, S, F] target features h_0 .. h_{S-1}
        steps: int,  # K unrolled steps (training-time test); 1 = plain teacher forcing
        start_pos: torch.Tensor | None = None,  # [B] RoPE position of entry 0 (default 0)
    ) -> list[torch.Tensor]:  # K tensors [B, S, H]: step s at entry j predicts the feature of position j+1+s
        """EAGLE-3's training-time test: step s feeds step s-1's outputs, and entry j of step s attends to step-0
        entries 0..j plus its own entries of steps 1..s (the diagonal) -- exactly what a chain draft sees."""
        b, s, _ = feats.shape
        dev = feats.device
        pos0 = torch.arange(s, device=dev).expand(b, s)
        if start_pos is not None:
            pos0 = pos0 + start_pos[:, None]
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
        diag = torch.eye(s, dtype=torch.bool, device=dev)
        outs: list[torch.Tensor] = []
        past: DraftKV | None = None
        hid = feats
        for st in range(steps):
            toks = tokens[:, st: st + s]
            if st == 0:
                out, past = self.step(toks, hid, pos0, None, None)
            else:
                assert past is not None
                mask = torch.cat([causal] + [diag] * st, dim=1).expand(b, s, (st + 1) * s)
                out, past = self.step(toks, hid, pos0 + st, past, mask)
            outs.append(out)
            hid = out
        return outs
