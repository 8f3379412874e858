"""The plain decode step as one fixed-shape body: forward of rows 0..B-1 on their roots -> processed distribution
-> sample with each row's own random stream -> log-probs -> commit (EOS / max_new_tokens). No host sync.

The same body runs eagerly (CPU, `cuda_graphs=False`: the reference), captured whole in a CUDA graph
(rollout/graphs.py) and, for small batches, torch.compile'd before capture. The sampler's Exp(1) noise [B, V] is a
pure function of each row's stream key and emitted count (`RowState.key`, `n_gen`; decoding/streams.py), so a row's
token depends on neither the other rows nor the step that runs it (a preempted row resumes its stream exactly). It
is computed eagerly (`DecodeStep.noise`) -- by a graph, into a static buffer right before each replay; the compiled
parts are the two deterministic halves around it: `head` (forward + logits processing) and `tail` (pick + log-prob
+ commit).

Sampling mode (`Mode`, from the rows' RequestSampling; what the processing depends on; fixed per captured graph,
part of its key):
- `GREEDY`: every active row has temperature 0: argmax, log-prob = log_softmax;
- `Mode("uniform", temperature, top_p, top_k)`: every active row shares one setting: scalar processing (top-k by
  torch.topk, no sort);
- `MIXED`: per-row settings read from RowState's temp / top_p / top_k tensors (fixed addresses, the RowSampling the
  sampler reads); greedy rows report log_softmax, as in plain greedy decoding.

With the fused forward on, GREEDY and uniform modes without top-p (and a top-k the kernels take) skip all of the
above after the forward: kernels/sample_commit.py goes from the logits to the committed row state in two Triton
kernels (the ~40 torch kernels of processing, pick, log-prob and commit are launch-bound at batch 1), with the same
tokens for the same noise, which is still computed outside, as above (`DecodeStep.samples_fused` says which path runs).

Run the tests: `python -m pytest tests/engine/test_engine_decode_step.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from worker.tlt.decoding.kv_cache import KVCache
from worker.tlt.decoding.row_state import RowState
from worker.tlt.decoding.sampling import pick_with_noise, processed_probs, token_logprobs
from worker.tlt.decoding.streams import SAMPLE
from worker.tlt.kernels import fused_available, stream_noise
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.types import RequestSampling


class Mode(NamedTuple):
    """A batch's sampling mode (module docstring); hashable, a key of the captured graphs."""

    kind: Literal["greedy", "uniform", "mixed"]
    temperature: float = 0.0  # uniform: the rows' common setting (> 0)
    top_p: float = 1.0
    top_k: int = 0


GREEDY = Mode("greedy")
MIXED = Mode("mixed")


def sampling_mode(rows: Sequence[RequestSampling]) -> Mode:
    """The mode of a batch from its rows' settings (module docstring)."""
    if all(p.temperature <= 0.0 for p in rows):
        return GREEDY
    first = rows[0]
    if all((p.temperature, p.top_p, p.top_k) == (first.temperature, first.top_p, first.top_k) for p in rows):
        return Mode("uniform", float(first.temperature), float(first.top_p), int(first.top_k))
    return MIXED


def choose_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, V] -> (token [B], lp [B])
    tok = logits.argmax(dim=-1)
    return tok, torch.log_softmax(logits.float(), dim=-1).gather(1, tok[:, None]).squeeze(1)


def process(
    logits: torch.Tensor,  # [B, V]
    mode: Mode,  # uniform or MIXED
    temp: torch.Tensor,  # [B] per-row settings (read in MIXED mode only)
    top_p: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (probs [B, V] float32, log_softmax [B, V] for greedy rows or None)
    if mode.kind == "uniform":
        t, p, k = mode.temperature, mode.top_p, mode.top_k
        if p >= 1.0 and k <= 0:
            return torch.softmax(logits.float() / t, dim=-1), None  # = processed_probs without its filter passes
        return processed_probs(logits, t, p, k), None
    return processed_probs(logits, temp, top_p, top_k), torch.log_softmax(logits.float(), dim=-1)


def choose_sampled(
    probs: torch.Tensor,  # [B, V] processed distribution
    noise: torch.Tensor,  # [B, V] Exp(1) draws
    lsm: torch.Tensor | None,  # [B, V] log_softmax (MIXED mode) or None
    temp: torch.Tensor,  # [B] per-row temperature (MIXED mode: greedy rows report log_softmax)
) -> tuple[torch.Tensor, torch.Tensor]:  # (token [B], lp [B])
    tok = pick_with_noise(probs, noise)
    lp = token_logprobs(probs, tok)
    if lsm is not None:
        lp = torch.where(temp <= 0.0, lsm.gather(1, tok[:, None]).squeeze(1), lp)
    return tok, lp


def row_noise(rows: RowState, sel: slice, vocab: int) -> torch.Tensor:
    """The sampler's Exp(1) noise [B, V] of rows `sel` for the token each decides next: keyed on the row's stream
    and emitted count (decoding/streams.py), so the same whatever else is in the batch."""
    return stream_noise(rows.key[sel], rows.n_gen[sel], SAMPLE, vocab)


def choose(logits: torch.Tensor, mode: Mode, rows: RowState, sel: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager sampling of logits [B, V] for rows `sel` (prefill's first token) -> (token [B], lp [B])."""
    if mode == GREEDY:
        return choose_greedy(logits)
    temp = rows.temp[sel]
    probs, lsm = process(logits, mode, temp, rows.top_p[sel], rows.top_k[sel])
    return choose_sampled(probs, row_noise(rows, sel, logits.shape[-1]), lsm, temp)


def hook_rows(
    final: torch.Tensor,  # [..., H] final-norm hidden
    captured: dict[int, torch.Tensor],  # {layer i: hidden entering layer i [..., H]} from forward_hidden
    layers: tuple[int, ...],  # EngineConfig.capture_layers
) -> torch.Tensor:  # [..., (len(layers) + 1) * H]
    """What the hidden-state hook receives: the captured layer inputs in `layers` order, then the final hidden."""
    if not layers:
        return final
    return torch.cat([captured[i] for i in layers] + [final], dim=-1)


@dataclass(frozen=True)
class StepOut:
    """What one decode step leaves behind (static tensors when replayed from a CUDA graph: read them before the
    next replay, i.e. enqueue their consumers right away)."""

    n: torch.Tensor  # [B] int64 tokens emitted (0 for finished and padding rows)
    roots: torch.Tensor  # [B] int64 the tokens fed to the forward (their K/V entered the cache)
    hidden: torch.Tensor  # [B, (k+1)H] hook rows at the roots (rollout/decode_step.hook_rows; [B, H] by default)


class DecodeStep:
    """The decode body over the engine's model, KV cache and row state (module docstring).
    `compile_max_batch` > 0 compiles head and tail for batches up to it (`compiler`: a torch.compile backend,
    `compile_mode` its mode: never one with CUDA graphs of its own, as rollout/graphs.py captures the step);
    `capture_layers`: the step's hidden output also carries those layers' inputs (`hook_rows`); `fused`: the cached
    forward (`forward_hidden`, also the verify forward's) runs worker/tlt/kernels' Triton kernels for calls of at
    most `fused_max_seqs` sequences (EngineConfig.fused_max_seqs; larger batches run torch), and only the tail is
    compiled (dynamo would gain nothing on a forward that is already a few fused kernels per layer); with it,
    `fused_sampler` (on by default) samples and commits in kernels/sample_commit.py where it can
    (`samples_fused`)."""

    def __init__(self, model: Transformer, cache: KVCache, rows: RowState, *,
                 compile_max_batch: int = 0, compiler: str = "inductor", compile_mode: str | None = None,
                 capture_layers: tuple[int, ...] = (), fused: bool = False, fused_max_seqs: int = 64,
                 fused_sampler: bool = True) -> None:
        self.model, self.cache, self.rows = model, cache, rows
        self.capture_layers = capture_layers
        self.compile_max_batch = compile_max_batch
        self.fused_max_seqs = fused_max_seqs
        self._fused_forward: Callable[..., tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]] | None = None
        self._sample_commit: Callable[..., torch.Tensor] | None = None
        self._sampler_takes: Callable[[int, int, int], bool] = lambda top_k, vocab, batch: False
        if fused:
            from worker.tlt.kernels.forward import cached_forward  # imports triton: only when asked for

            self._fused_forward = cached_forward(model)
            from worker.tlt.kernels.gemm_forward import prefers_gemm

            # paged: torch's forward would gather every row's pages per layer; the GEMM path (cuBLAS GEMMs, which
            # do not re-read weights per 16-row tile) reads them in place at any batch
            if cache.paged and prefers_gemm(model.args, model.head_weight.element_size()):
                self.fused_max_seqs = 1 << 30
        # the fused sampler where Triton runs on the logits' device: CUDA, or CPU in Triton's interpreter (tests)
        if fused and fused_sampler and fused_available(model.head_weight.device) is None:
            from worker.tlt.kernels.sample_commit import sample_commit, supported

            self._sample_commit, self._sampler_takes = sample_commit, supported
        self._cols = torch.arange(cache.max_len, device=rows.lens.device)
        self._head_c: Callable[..., Any] = self.head
        self._tail_c: Callable[..., Any] = self.tail
        if compile_max_batch > 0:
            # one compile per (batch bucket, mode) and per engine (the guards see this engine's tensors): raise
            # dynamo's default of 8 so that a process with several engines never falls back to eager silently
            dyn = torch._dynamo.config
            dyn.recompile_limit = max(dyn.recompile_limit, 64)
            # default mode, not "reduce-overhead": we capture the graphs ourselves (rollout/graphs.py)
            if not fused:
                self._head_c = torch.compile(self.head, dynamic=False, backend=compiler, mode=compile_mode)
            self._tail_c = torch.compile(self.tail, dynamic=False, backend=compiler, mode=compile_mode)

    @property
    def fused(self) -> bool:  # the cached forward runs the fused kernels (up to fused_max_seqs sequences)
        return self._fused_forward is not None

    @property
    def commits_fused(self) -> bool:
        """Commits run in Triton kernels (the fused sampler's condition: fused on, Triton runs on the device); the
        speculative body's commit follows it (kernels/spec_commit.py)."""
        return self._sample_commit is not None

    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S]
        cache: KVCache,
        **kw: Any,  # cache_rows, write_idx, attn_mask, logits_at, layers (Transformer.forward_hidden's)
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The cached forward (decode and verify): the fused kernels for batches of up to `fused_max_seqs` sequences,
        else torch. B is a shape, so a captured graph always takes the same side; and a batch's decode and verify
        forwards take the same side whatever their tokens per sequence."""
        if self._fused_forward is not None and input_ids.shape[0] <= self.fused_max_seqs:
            return self._fused_forward(input_ids, positions, cache, **kw)
        return self.model.forward_hidden(input_ids, positions, cache, **kw)

    def samples_fused(self, mode: Mode, batch: int = 1) -> bool:
        """Whether the step after the forward is kernels/sample_commit.py's two kernels: the fused forward and its
        sampler are on (`fused_sampler`, where Triton runs) and the mode is GREEDY or one uniform setting with
        top-p off and a top-k it takes at this batch (`supported`). MIXED, top-p, large top-k and large batches keep
        the torch path."""
        if self._sample_commit is None:
            return False
        if mode == GREEDY:
            return self._sampler_takes(0, self.vocab, batch)
        if mode.kind != "uniform":
            return False
        return mode.temperature > 0.0 and mode.top_p >= 1.0 and self._sampler_takes(mode.top_k, self.vocab, batch)

    @property
    def vocab(self) -> int:
        return int(self.model.head_weight.shape[0])

    def noise(self, batch: int, row0: int = 0) -> torch.Tensor:
        """The Exp(1) noise [B, V] of rows row0..row0+B-1 for their next tokens (`row_noise`)."""
        return row_noise(self.rows, slice(row0, row0 + batch), self.vocab)

    def compiled(self, batch: int) -> bool:
        return batch <= self.compile_max_batch

    def forward(self, batch: int, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward of rows 0..batch-1 on their root tokens -> (logits [B, V], hook rows [B, (k+1)H])."""
        ids = self.rows.last[:batch, None]  # [B, 1]
        pos = self.rows.lens[:batch, None]  # [B, 1]
        mask = self._cols[:tk][None, None, :] <= pos[:, :, None]  # [B, 1, tk]
        logits, hidden, cap = self.forward_hidden(ids, pos, self.cache, write_idx=pos, attn_mask=mask,
                                                  layers=self.capture_layers)
        return logits[:, 0], hook_rows(hidden, cap, self.capture_layers)[:, 0]

    def head(self, batch: int, tk: int, mode: Mode) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Forward + processing -> (greedy: token [B] / else probs [B, V], greedy: lp [B] / else lsm or None, hidden)."""
        logits, hidden = self.forward(batch, tk)
        if mode == GREEDY:
            tok, lp = choose_greedy(logits)
            return tok, lp, hidden
        probs, lsm = process(logits, mode, self.rows.temp[:batch], self.rows.top_p[:batch], self.rows.top_k[:batch])
        return probs, lsm, hidden

    def tail(self, batch: int, mode: Mode, a: torch.Tensor, b: torch.Tensor | None,
             noise: torch.Tensor | None) -> torch.Tensor:
        """Pick (sampled modes) and commit -> tokens emitted per row [B]."""
        if mode == GREEDY:
            tok, lp = a, b
        else:
            assert noise is not None
            tok, lp = choose_sampled(a, noise, b, self.rows.temp[:batch])
        assert lp is not None
        return self.rows.commit_no_sync(slice(0, batch), tok[:, None], lp[:, None], torch.ones_like(tok))

    def fused_tail(self, batch: int, mode: Mode, logits: torch.Tensor, noise: torch.Tensor | None,
                   row0: int = 0) -> torch.Tensor:
        """`tail` in kernels/sample_commit.py (`samples_fused` modes) from the logits [B, V] of rows row0..row0+B-1
        (prefill's first tokens start past the active rows) -> tokens emitted [B]."""
        assert self._sample_commit is not None
        if mode == GREEDY:
            return self._sample_commit(logits, None, self.rows, batch, 0.0, 0, row0=row0)
        if noise is None:
            noise = self.noise(batch, row0)  # eager: the same draws as the torch path's
        return self._sample_commit(logits, noise, self.rows, batch, mode.temperature, mode.top_k, row0=row0)

    def __call__(self, batch: int, tk: int, mode: Mode, noise: torch.Tensor | None = None) -> StepOut:
        """noise: the sampler's Exp(1) draws [B, V] for sampled modes; None computes them here (`noise`; a CUDA
        graph passes a static buffer refilled by that same call before each replay)."""
        roots = self.rows.last[:batch].clone()
        if self.samples_fused(mode, batch):
            logits, hidden = self.forward(batch, tk)
            return StepOut(self.fused_tail(batch, mode, logits, noise), roots, hidden)
        head, tail = (self._head_c, self._tail_c) if self.compiled(batch) else (self.head, self.tail)
        a, b, hidden = head(batch, tk, mode)
        if mode != GREEDY and noise is None:
            noise = self.noise(batch)  # eager: the rows' own streams
        n = tail(batch, mode, a, b, noise)
        return StepOut(n, roots, hidden)
