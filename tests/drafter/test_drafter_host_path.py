"""The speculative step's host path (commit 5605350) on CPU: HiddenStateBuffer's deferred captures are visible to
every read (len, sample, the checkpoint, begin_step) and give the ring that the same rows written one call at a time
give; HostStage's uploads keep their values as its buffer is reused and grows; FeatureRing.pack, which keeps each
sequence's last W history tokens on the host and writes only new ones, equals the layout rebuilt from the full
histories and features.

Run the tests: `python -m pytest tests/drafter/test_drafter_host_path.py -q`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from worker.tlt.decoding.uploads import HostStage, SeqIds
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.speculative.drafter.feature_ring import FeatureRing
from worker.tlt.speculative.proposers.protocol import DraftContext

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------ HiddenStateBuffer
class _Hook:
    """Drives an EngineCapture as the engine does and records the rows it should keep: a request's first call is its
    prefill (only its last row kept), every later row is a response row."""

    def __init__(self, cap: EngineCapture, width: int) -> None:
        self.cap, self.width = cap, width
        self.kept: list[tuple[int, int, int]] = []  # (sequence id, token, step) of every kept row, in order
        self.calls: list[tuple[list[int], list[int], int]] = []  # kept rows per call: (ids, tokens, step)
        self._seen: set[int] = set()
        self._tok = itertools.count(1000)

    def __call__(self, runs: list[tuple[tuple[int, int], int]], step: int, key: object = None) -> None:
        seq = [sid for sid, n in runs for _ in range(n)]
        toks = [next(self._tok) for _ in seq]
        hid = torch.tensor([[float(t), float(-t)] for t in toks]).repeat(1, self.width // 2)  # [N, F] from the token
        new = {r for (r, _), _ in runs if r not in self._seen}
        ids, kt = [], []
        for i, ((r, s), t) in enumerate(zip(seq, toks, strict=True)):
            if r in new and i + 1 < len(seq) and seq[i + 1][0] == r:
                continue  # a prompt row that is not its prefill's last
            ids.append((self.cap.epoch << 40) + r * self.cap.max_samples + s)
            kt.append(t)
        self._seen |= new
        self.kept += [(i, t, step) for i, t in zip(ids, kt, strict=True)]
        self.calls.append((ids, kt, step))
        self.cap(SeqIds(runs, key=key) if key is not None else seq, torch.tensor(toks), hid)


def _expected_ring(kept: list[tuple[int, int, int]], capacity: int, step: int, keep_steps: int
                   ) -> tuple[list[int], list[int], list[int]]:
    """Tokens, sequence ids, steps per ring slot: kept row j in slot j % capacity, live while its step is recent."""
    tok, seq, stp = [0] * capacity, [-1] * capacity, [-1] * capacity
    for j, (i, t, s) in enumerate(kept):
        tok[j % capacity], seq[j % capacity], stp[j % capacity] = t, i, s if s > step - keep_steps else -1
    return tok, seq, stp


def _replay(calls: list[tuple[list[int], list[int], int]], ref: HiddenStateBuffer, width: int) -> None:
    """The same kept rows, one capture per hook call with tensor ids (written at once, never deferred)."""
    for ids, toks, step in calls:
        if step != ref.current_step:
            ref.begin_step(step)
        if ids:
            hid = torch.tensor([[float(t), float(-t)] for t in toks]).repeat(1, width // 2)
            ref.capture(torch.tensor(ids), torch.tensor(toks), hid)


def _ring_state(buf: HiddenStateBuffer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in buf.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("defer_rows", [4096, 5])  # everything deferred until read / a forced write mid-way
def test_deferred_captures_are_visible_to_every_read(defer_rows: int) -> None:
    width, capacity = 2, 24
    make = lambda: HiddenStateBuffer(width, budget_bytes=capacity * (width * 4 + 24), dtype=torch.float32)  # noqa: E731
    buf, ref = make(), make()
    assert buf.capacity == capacity
    buf.defer_rows = defer_rows
    hook = _Hook(EngineCapture(buf), width)
    done = 0  # hook calls already replayed into ref

    def replay_ref() -> None:
        nonlocal done
        _replay(hook.calls[done:], ref, width)
        done = len(hook.calls)

    def check(step: int) -> None:
        tok, seq, stp = _expected_ring(hook.kept, capacity, step, buf.keep_steps)
        assert buf.tokens.tolist() == tok and buf.seq.tolist() == seq and buf.step.tolist() == stp
        assert buf.hidden[:, 0].tolist() == [float(t) if s >= 0 else 0.0 for t, s in zip(tok, seq, strict=True)]
        replay_ref()
        for k, v in _ring_state(ref).items():
            assert torch.equal(_ring_state(buf)[k], v), k
        assert buf.written == ref.written == len(hook.kept)

    # step 0: two prefills (5- and 3-row prompts), then speculative steps over the same rows (one key: the cached ids)
    buf.begin_step(0)
    hook([((0, 0), 5), ((1, 0), 3)], 0)
    for n in ([2, 1, 3], [1, 1, 1], [4, 2, 1]):
        hook([((0, 0), n[0]), ((0, 1), n[1]), ((1, 0), n[2])], 0, key=("rows", 1))
    if defer_rows > 100:
        assert buf.written == 0  # nothing written yet: the reads below must write the rows themselves
    replay_ref()
    assert len(buf) == len(ref) == len(hook.kept) == 2 + 6 + 3 + 7  # len reads the deferred rows (no flush call)
    check(0)
    assert buf.sample(4, 4) is not None  # a window index built now must not hide the rows deferred next

    # step 1: a new request's prefill in the same call as decode rows; begin_step with rows still deferred
    hook([((0, 0), 1), ((2, 0), 4), ((1, 0), 2)], 0)
    buf.begin_step(1)  # the rows above belong to step 0
    hook([((0, 0), 2), ((2, 0), 3)], 1, key=("rows", 2))
    hook([((0, 0), 1), ((2, 0), 2)], 1, key=("rows", 2))
    replay_ref()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    # sample first (no flush before it): its windows must be drawn from the same rows as ref's
    a = buf.sample(16, 4, g1)
    b = ref.sample(16, 4, g2)
    assert a is not None and b is not None
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden, b.hidden) and torch.equal(a.lengths, b.lengths)
    check(1)


def test_deferred_rows_wrap_the_ring_and_survive_a_checkpoint() -> None:
    width, capacity = 2, 24
    make = lambda: HiddenStateBuffer(width, budget_bytes=capacity * (width * 4 + 24), dtype=torch.float32)  # noqa: E731
    buf, ref = make(), make()
    hook = _Hook(EngineCapture(buf), width)
    for step in range(3):
        buf.begin_step(step)  # step 2 drops step 0's rows (keep_steps = 2)
        hook([((10 + step, 0), 3), ((20 + step, 0), 2)], step)
        for i in range(6):  # 6 x 6 rows + 2 prefill rows per step > capacity: one deferred write wraps the ring
            hook([((10 + step, 0), 1 + i % 3), ((10 + step, 1), 2), ((20 + step, 0), 3 - i % 3)], step,
                 key=("wrap", step))
    assert buf.written < len(hook.kept)  # the last step's rows are still deferred
    _replay(hook.calls, ref, width)  # begin_step at the same points
    state = buf.state_dict()  # a checkpoint reads the deferred rows
    tok, seq, stp = _expected_ring(hook.kept, capacity, 2, buf.keep_steps)
    assert len(buf) == len(ref) == sum(s >= 0 for s in stp) == capacity  # the ring is full of step 2's newest rows
    assert buf.written == ref.written == len(hook.kept)
    assert buf.tokens.tolist() == tok and buf.seq.tolist() == seq and buf.step.tolist() == stp
    ref_state = ref.state_dict()
    for k, v in ref_state.items():
        assert torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v, k
    # round trip: a fresh buffer loaded from the checkpoint samples what the original samples
    back = make()
    back.load_state_dict(state)
    x, y = back.sample(12, 5, torch.Generator().manual_seed(7)), buf.sample(12, 5, torch.Generator().manual_seed(7))
    assert x is not None and y is not None
    assert torch.equal(x.tokens, y.tokens) and torch.equal(x.hidden, y.hidden) and torch.equal(x.lengths, y.lengths)
    # windows are consecutive rows of one sequence in capture order
    order = {t: j for j, (_, t, _) in enumerate(hook.kept)}
    for b in range(12):
        rows = [order[int(t)] for t in y.tokens[b, : int(y.lengths[b])]]
        assert len({hook.kept[j][0] for j in rows}) == 1 and rows == sorted(rows)
        same = [j for j, (i, _, s) in enumerate(hook.kept) if i == hook.kept[rows[0]][0] and s == 2]
        assert rows == same[same.index(rows[0]): same.index(rows[0]) + len(rows)]  # no row of the sequence skipped


# --------------------------------------------------------------------------------------------------------- HostStage
def test_host_stage_uploads_keep_their_values_as_the_buffer_is_reused_and_grows() -> None:
    stage = HostStage(CPU)
    rng = np.random.default_rng(0)
    for n in (3, 0, 3000, 10, 700, 20000, 10, 4999):  # 3000, 20000 grow the staged buffer (1024 first) over 2x
        a = rng.integers(-(2**40), 2**40, n)
        b = list(range(n % 7))
        c = rng.integers(0, 9, n // 3)
        out = stage.put(a, b, range(2), c)  # arrays, lists, ranges: one buffer, parts back to back
        assert [t.dtype for t in out] == [torch.int64] * 4 and [t.shape[0] for t in out] == [n, n % 7, 2, n // 3]
        assert out[0].tolist() == a.tolist() and out[1].tolist() == b and out[2].tolist() == [0, 1]
        assert out[3].tolist() == c.tolist()
        got = [t.clone() for t in out]  # what a consumer read before the next upload (as index_copy_ does)
        nxt = stage.put(rng.integers(0, 5, 2 * n + 1))[0]
        assert nxt.shape[0] == 2 * n + 1
        assert got[0].tolist() == a.tolist() and got[3].tolist() == c.tolist()


def test_host_stage_host_for_writes_the_destination() -> None:
    stage = HostStage(CPU)
    d1, d2 = torch.zeros(2, 5, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)
    h1 = stage.host_for(d1)
    assert h1.shape == (10,) and stage.host_for(d1) is h1  # the same array while nothing else wrote into it
    h1[:] = np.arange(10)
    h2 = stage.host_for(d2)
    h2[:] = 7
    stage.send(d1)
    stage.send(d2)
    assert d1.view(-1).tolist() == list(range(10)) and d2.tolist() == [7] * 7
    stage.put([1, 2, 3])  # an upload in between leaves host_for's destination alone
    h1[3] = 42
    stage.send(d1)
    assert d1.view(-1).tolist() == [0, 1, 2, 42, 4, 5, 6, 7, 8, 9] and d2.tolist() == [7] * 7


# ------------------------------------------------------------------------------------------------------- FeatureRing
def _reference_pack(ctx: DraftContext, feats: dict[tuple[int, int], list[list[float]]], w: int,
                    rows: int) -> tuple[np.ndarray, list[torch.Tensor]]:
    """FeatureRing.pack's documented layout from the full histories, with the features the ring columns must read:
    [0, W) the last W history tokens right-aligned (the last is the root), 2W the valid entries m = min(features
    seen, W, history - 1), 2W + 1 the history length; [W, 2W) (returned apart, as the features they must gather) the
    last m features of the sequence, right-aligned, index 0 elsewhere."""
    arr = np.zeros((rows, 2 * w + 2), dtype=np.int64)
    want = []
    for b, (h, g, s) in enumerate(zip(ctx.histories, ctx.group_ids, ctx.sample_ids, strict=True)):
        tail = list(h)[-w:]
        arr[b, w - len(tail): w] = tail
        f = feats.get((g, s), [])
        m = min(len(f), w, len(h) - 1)
        arr[b, 2 * w], arr[b, 2 * w + 1] = m, len(h)
        want.append(torch.tensor(f[len(f) - m:], dtype=torch.float32).reshape(m, 2))  # F = 2 in these tests
    return arr, want


def _check_pack(ring: FeatureRing, ctx: DraftContext, feats: dict[tuple[int, int], list[list[float]]],
                rows: int, staged: torch.Tensor, stage: HostStage) -> None:
    w, bsz = ring.context, ctx.batch_size
    ref, want = _reference_pack(ctx, feats, w, rows)

    def check_ring(idx: np.ndarray) -> None:  # [B, W] ring indices: the last m columns read the last m features
        for b in range(bsz):
            m = int(ref[b, 2 * w])
            assert (idx[b, : w - m] == 0).all()
            got = ring.gather(torch.from_numpy(np.ascontiguousarray(idx[b: b + 1])))[0, w - m:]
            assert torch.equal(got, want[b]), (b, got, want[b])

    plain = ring.pack(ctx, rows)  # a fresh array
    assert plain.shape == (rows, 2 * w + 2)
    ring_cols = plain[:, w: 2 * w].copy()
    plain[:, w: 2 * w] = 0
    assert np.array_equal(plain, ref)
    assert (ring_cols[bsz:] == 0).all()
    check_ring(ring_cols[:bsz])
    # lead: the ring indices [rows, W] first, then the array with [W, 2W) zero; written into a reused staging buffer
    buf = ring.pack(ctx, rows, lead=True, out=stage.host_for(staged))
    stage.send(staged)
    flat = staged.numpy()
    assert buf.shape == flat.shape and np.shares_memory(buf, flat)
    lead = flat[: rows * w].reshape(rows, w)
    assert (lead[bsz:] == 0).all() and np.array_equal(lead[:bsz], ring_cols[:bsz])
    assert np.array_equal(flat[rows * w:].reshape(rows, 2 * w + 2), ref)


def test_pack_equals_a_rebuild_from_the_full_histories() -> None:
    w, f = 4, 2
    ring = FeatureRing(w, f, CPU, slots=2)  # slots grow on the host (tokens) and the device (features)
    rng = np.random.default_rng(1)
    hist: dict[tuple[int, int], list[int]] = {}  # the engine's token lists: they only grow (until reset)
    feats: dict[tuple[int, int], list[list[float]]] = {}
    code = itertools.count(1)  # unique feature values: a ring index reading a stale cell shows
    stage = HostStage(CPU)
    staged = {rows: torch.zeros(rows * w + rows * (2 * w + 2), dtype=torch.int64) for rows in (4, 8)}

    def observe(runs: list[tuple[tuple[int, int], int]], key: object = None) -> None:
        rows = []
        for sid, n in runs:
            new = [[float(next(code)), float(len(feats.setdefault(sid, [])))] for _ in range(n)]
            feats[sid] += new
            rows += new
        hidden = torch.tensor(rows)
        hidden = torch.cat([hidden, torch.full((len(rows), 1), -1.0)], 1)  # a trailing column pack never reads
        seq = [sid for sid, n in runs for _ in range(n)]
        ring.observe(SeqIds(runs, seq, key) if key is not None else seq, hidden)

    def grow(*adds: tuple[tuple[int, int], int]) -> None:  # (sequence, new tokens) ...
        for sid, n in adds:
            hist.setdefault(sid, []).extend(int(t) for t in rng.integers(1, 500, n))

    def context(sids: list[tuple[int, int]]) -> DraftContext:
        return DraftContext(histories=[hist[s] for s in sids], prompt_lens=[1] * len(sids),
                            group_ids=[g for g, _ in sids], sample_ids=[s for _, s in sids], max_nodes=4, max_depth=3)

    a, a1, b, c, d = (0, 0), (0, 1), (1, 0), (2, 0), (3, 0)
    # prefills: a prompt longer than W (one call brings more rows than the ring holds), a short one
    grow((a, 9), (b, 2))
    observe([(a, 8), (b, 1)])
    grow((a1, 9))  # a sibling: shares the prompt, no features of its own yet
    hist[a1][:9] = hist[a][:9]
    ctx = context([a, a1, b])  # one context reused while its rows stay (its histories are the growing lists)
    _check_pack(ring, ctx, feats, 4, staged[4], stage)
    for _ in range(7):  # speculative steps: 1-4 new tokens per row, their features (the root's comes next step)
        adds = [int(x) for x in rng.integers(1, 5, 3)]
        observe([(s, n) for s, n in zip((a, a1, b), adds, strict=True)], key=("abc", 0))
        for s, n in zip((a, a1, b), adds, strict=True):
            grow((s, n))
        _check_pack(ring, ctx, feats, 4, staged[4], stage)
    # the batch changes: a1 finished, c and d join (c's prefill interleaved with decode rows, a repeated run of a)
    grow((c, 6), (d, 1))
    observe([(a, 1), (c, 5), (a, 2), (b, 1)])
    grow((a, 3), (b, 1))
    ctx = context([c, b, d, a])  # another order; d has no features at all
    for step in range(5):
        _check_pack(ring, ctx, feats, 4, staged[4], stage)
        _check_pack(ring, ctx, feats, 8, staged[8], stage)  # more padding rows, another staging buffer
        adds = [int(x) for x in rng.integers(1, 6, 4)]
        observe([(s, n) for s, n in zip((c, b, d, a), adds, strict=True)], key=("cbda", step % 2))
        if step % 2:
            _check_pack(ring, ctx, feats, 4, staged[4], stage)  # features ahead of the history (m <= history - 1)
        for s, n in zip((c, b, d, a), adds, strict=True):
            grow((s, n))
    observe([(d, 1), (c, 2), (b, 1), (a, 1)])  # as many runs as the last call, other sequences: other slots
    grow((d, 1), (c, 2), (b, 1), (a, 1))
    _check_pack(ring, context([a, c]), feats, 4, staged[4], stage)  # fewer rows into the same staging buffer
    _check_pack(ring, context([c, a]), feats, 4, staged[4], stage)  # another context of as many rows
    _check_pack(ring, ctx, feats, 4, staged[4], stage)
    # a new rollout: the ids come back, in the same order, with new histories a little longer than the last ones
    old = {s: len(h) for s, h in hist.items()}
    ring.reset()
    hist.clear()
    feats.clear()
    grow((a, old[a] + 2), (b, old[b] + 1))
    observe([(a, old[a] + 1), (b, old[b])])
    ctx = context([b, a])
    for _ in range(3):
        _check_pack(ring, ctx, feats, 4, staged[4], stage)
        observe([(b, 2), (a, 1)])
        grow((b, 2), (a, 1))
    _check_pack(ring, ctx, feats, 4, staged[4], stage)
