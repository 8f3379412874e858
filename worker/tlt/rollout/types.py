"""The rollout engine's configs and records: per-request `RequestSampling`, `Request`, `EngineConfig`, and what
`Engine.generate` returns (`SequenceResult` per sequence, `StepStats` per engine step). Speculative decoding is the
controller's (rollout/controller_protocol.py), a row's sampling settings on the device decoding/sampling.py's `RowSampling`.

Pure data; see `rollout/engine.py` for the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal


@dataclass(frozen=True)
class RequestSampling:
    """Per-request generation settings (the processed distribution is decoding/sampling.py's)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # cap on emitted tokens (the EOS token counts)
    eos_ids: tuple[int, ...] | None = None  # None = the engine's default (tokenizer EOS ids)
    n: int = 1  # samples per prompt (a GRPO group); they share one prefill
    # the request's own random seed: its samples' streams are keyed on (seed, sample index) alone, so the same seed
    # gives the same tokens whatever the engine's seed, the batch or preemption (as vLLM's per-request seed, whose
    # siblings also differ by index); None = derived from the engine's generator, one draw per generate() call
    seed: int | None = None

    def greedy(self) -> RequestSampling:
        """These settings decoded greedily (validation rollouts): temperature 0, the rest kept."""
        return replace(self, temperature=0.0)


@dataclass(frozen=True)
class Request:
    prompt: list[int]  # prompt token ids (already chat-templated)
    params: RequestSampling = field(default_factory=RequestSampling)


@dataclass(frozen=True)
class EngineConfig:
    max_len: int = 2048  # prompt + new tokens per sequence (KV columns, before headroom)
    max_slots: int | None = None  # sequences resident at once; None = from kv_cache_gb
    kv_cache_gb: float = 8.0  # KV memory budget when max_slots is None (paged: when kv_pages is None)
    # KV layout (decoding/kv_cache.py): None = rows of max_len columns per sequence; P = pages of P columns handed
    # out as sequences grow, admission by free pages, the youngest sequence preempted (swapped to host memory and
    # back) when a running one needs a page and none is free (rollout/paging.py)
    page_size: int | None = None
    kv_pages: int | None = None  # paged: pages in the pool; None = what max_slots full rows would take, else kv_cache_gb
    sync_every: int = 8  # plain decode steps between host checks for finished sequences
    # capture the WHOLE plain decode step (forward, sampling, log-probs, commit) per (batch bucket, attention-length
    # bucket, sampling mode) in CUDA graphs sharing Engine.graph_pool; CUDA only
    cuda_graphs: bool = True
    compile: bool = False  # torch.compile the decode step body of small batches before capture (CUDA only)
    compile_max_batch: int = 8  # batch buckets up to this are compiled (each once, at the full attention length)
    compile_mode: str | None = None  # torch.compile mode, e.g. "max-autotune-no-cudagraphs" (we capture ourselves)
    # decode / verify forwards in 5 Triton kernels per layer (worker/tlt/kernels; prefill stays torch). None = on
    # where it can run on CUDA; True = required (on CPU: Triton's interpreter, for tests); False = torch. With it
    # on, `compile` compiles only the sampling tail of the decode step (the forward is already fused)
    fused_kernels: bool | None = None
    # largest batch (sequences B of a cached forward, whatever its tokens per sequence S) that takes the fused kernels;
    # larger ones run torch. Routing by B, not by B * S tokens, keeps a batch's plain decode and its speculative verify
    # on the same kernels, so greedy SD stays token-identical to plain greedy decoding in bf16 (routing by tokens sent a
    # 32-row verify of 6 tokens to torch and its decode to Triton: 33% identical tokens on the H200). The kernels tile
    # M by 16 rows with weights re-read per tile, fine for decode and verify of small batches but behind cuBLAS + SDPA
    # at hundreds of rows (64x8 rollout, 512-row steps); SD runs only on small batches (rollout.sd_on_below)
    fused_max_seqs: int = 64
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    attn_bucket: int = 256  # decode attends over columns 0..Tk-1, Tk rounded up to a multiple of this
    prefill_tokens: int = 16384  # padded prompt tokens per prefill forward
    # the engine's torch.Generator seed: each generate() draws one base seed from it, from which requests without
    # their own RequestSampling.seed get theirs (decoding/streams.py; the generator is what checkpoints save)
    seed: int = 0
    # target layers whose *input* hidden states the hidden-state hook also gets (EAGLE-3: (2, L//2, L-3)); with a hook
    # attached, every forward (prefill, decode graph, verify) hands it cat(layer inputs..., final-norm hidden) [N, (k+1)H]
    capture_layers: tuple[int, ...] = ()
    # Tail hook (adaptive engine): each step run with the SD switch on earns this fraction of its wall time as
    # credit for the hook (spot training between decode steps), so the hook slows the tail by about this much.
    tail_budget: float = 0.03
    tail_credit_cap_s: float = 0.5  # credit never banks beyond this many seconds (one hook call stays short)


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SequenceResult:
    request: int  # index of the request in generate()'s list
    sample: int  # 0..n-1 within the request
    tokens: list[int]  # emitted tokens (EOS included when finish_reason == "stop")
    logprobs: list[float]  # target log-prob of each emitted token (processed distribution; greedy: log_softmax)
    finish_reason: FinishReason


@dataclass(frozen=True)
class StepStats:
    kind: Literal["prefill", "decode", "spec"]
    active: int  # sequences in the batch (not counting bucket padding)
    bucket: int  # rows actually computed
    verify_tokens: int  # tokens per row in the target forward (1 for decode)
    emitted: int  # tokens emitted by the step (after EOS / budget truncation)
    accepted: int  # accepted draft tokens (spec steps)
    seconds: float  # wall time of the step (decode: the sync window's time shared equally)
    arm: str | None = None  # adaptive engine: the arm the controller planned ("none" = plain decoding)
    accepted_pos: tuple[int, ...] = ()  # spec steps: sequences whose k-th draft token was accepted, k = 1..D
    drafted_pos: tuple[int, ...] = ()  # spec steps: sequences that had a k-th draft token, k = 1..D


@dataclass
class GenerationOutput:
    sequences: list[SequenceResult]  # ordered by (request, sample)
    steps: list[StepStats]
    seconds: float  # wall time of generate()
    # adaptive engine: the controller's RolloutSdMetrics.summary() of this generate() (sd/*, perf/tokens_per_s_*)
    sd_metrics: dict[str, float] = field(default_factory=dict)
    sd_buckets: list[dict] = field(default_factory=list)  # ... and its per_bucket() rows (benchmark tables)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)
