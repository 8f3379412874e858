"""The spot trainer: trains the drafter on the hidden-state buffer in GPU time the rollout's long tail leaves idle.

Loss (EAGLE-1, Li et al. 2024), on response-token rows only (the buffer holds nothing else):
    SmoothL1(predicted feature, target feature h_{j+1}) + 0.1 * soft-CE(drafter logits, softmax(target logits))
where the target logits come from the frozen head applied to h_{j+1}. EAGLE-3: soft-CE only, over the draft vocab
(the target distribution restricted to it and renormalised), summed over `ttt_steps` unrolled steps weighted 0.8^s.
`drafter/acc` is top-1 agreement of the first step with the target's argmax.

A step never waits for the device: windows are drawn on the buffer's device with fixed shapes [B, W] (padding masked
in the loss), the EAGLE-1 soft-CE runs through `soft_ce.soft_cross_entropy` (chunked, no [N, V] tensors kept for
backward), the drafter forward runs under bf16 autocast on CUDA (losses in fp32), AdamW is fused on CUDA, and loss /
accuracy accumulate on the device; `metrics()` reads them (one host read). `train()` synchronises once at its end
(the step boundary it promises its caller) and keeps at most `max_inflight` steps queued ahead of the device, so a
deadline in `until()` is overrun by at most that many steps.

Preemptible: `train(until, max_steps)` runs small optimizer steps and checks `until()` between them, so it returns
at the next step boundary; every step is all-or-nothing (optimizer state and the step counter move together).
The engine never sees a half-trained drafter: `snapshot()` publishes a versioned copy of the trainable weights, and
the proposer loads it at the next rollout start. `save`/`load` move the trainable parameters only (safetensors);
`state_dict`/`load_state_dict` hold everything an exact resume needs (weights, AdamW state, the window-sampling and
feature-noise generators, counters), so a resumed run's next steps are bit-identical to the uninterrupted run's.

Metrics (`metrics()`): drafter/loss, drafter/acc, drafter/steps (cumulative), harvest/idle_gpu_s_total (idle GPU
time offered to the trainer, cumulative), harvest/used_gpu_s_total (time its harvested steps took, cumulative). The
per-step harvest/* figures are the caller's (speculative/drafter/online.py, multigpu/harvest.py): only it knows the step's idle
time.

Run the tests: `python -m pytest tests/drafter/test_drafter_train.py tests/drafter/test_drafter_spot_step.py -q`.
Time one step: `python -m worker.tlt.speculative.drafter.spot_trainer --bench --device cuda` (SmolLM2 shape, random weights).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worker.tlt import metric_catalog as mc
from worker.tlt.speculative.drafter.buffer import Batch, HiddenStateBuffer
from worker.tlt.speculative.drafter.model import EagleDrafter
from worker.tlt.speculative.drafter.soft_ce import CHUNK_ELEMS, soft_cross_entropy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpotTrainerConfig:
    learning_rate: float = 3e-4  # AdamW lr (the spec's drafter.learning_rate)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas (EAGLE's training script)
    batch_size: int = 16  # windows per step
    window: int = 128  # consecutive rows per window
    ce_weight: float = 0.1  # EAGLE-1: weight of the soft-CE term
    ttt_decay: float = 0.8  # EAGLE-3: weight of unrolled step s is ttt_decay ** s
    max_grad_norm: float = 0.5  # gradient clipping
    seed: int = 0  # window sampling
    ce_chunk_elems: int = CHUNK_ELEMS  # soft-CE logits per chunk (rows x vocab)
    max_inflight: int = 2  # CUDA: steps queued ahead of the device inside one `train` call


@dataclass(frozen=True)
class DrafterSnapshot:
    version: int  # increases with every publish
    state: dict[str, torch.Tensor]  # trainable parameters and buffers (detached copies)


def host_copy(obj: Any) -> Any:
    """Nested state with every tensor copied to the host: a snapshot that later steps cannot change, and one that
    pickles without a device (a pickled CUDA tensor would unpickle onto the sender's GPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class SpotTrainer:
    def __init__(
        self,
        drafter: EagleDrafter,  # the training copy (the engine's proposer holds its own, fed by snapshots)
        buffer: HiddenStateBuffer,
        cfg: SpotTrainerConfig = SpotTrainerConfig(),
    ) -> None:
        self.drafter, self.buffer, self.cfg = drafter, buffer, cfg
        self.device = next(drafter.parameters()).device
        params = [p for p in drafter.parameters() if p.requires_grad]
        # fused on CUDA: one kernel, step counters on the device (the CPU path keeps the single-tensor update)
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.learning_rate, betas=cfg.betas, weight_decay=cfg.weight_decay,
            fused=True if self.device.type == "cuda" else None,
        )
        self.generator = torch.Generator(device=buffer.device).manual_seed(cfg.seed)  # window starts (buffer device)
        self.noise_gen = torch.Generator(device=self.device).manual_seed(cfg.seed + 1)  # feature noise (device)
        self.steps = 0
        self.version = 0
        self.idle_gpu_s = 0.0
        self.used_gpu_s = 0.0
        # loss / accuracy sums since the last metrics(), on the device (read there, never per step)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._acc_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._n_since = 0

    # ------------------------------------------------------------------------------------------------ loss
    def _autocast(self) -> torch.autocast:
        return torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda")

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:  # -> (loss, top-1 accuracy), device scalars
        d = self.drafter
        tokens, lengths = batch.tokens.to(self.device), batch.lengths.to(self.device)
        rows = batch.hidden.to(self.device, torch.float32)  # [B, W, F (+H)]
        fdim = d.feature_dim
        feats = rows[..., :fdim]
        final = rows if d.cfg.kind == "eagle1" else rows[..., fdim:]
        b, w, _ = rows.shape
        k = d.cfg.ttt_steps
        s = w - 1  # entries j = 0..W-2: (x_{j+1}, h_j)
        if d.cfg.feature_noise > 0 and d.training:
            noise = (torch.rand(feats.shape, generator=self.noise_gen, device=feats.device) * 2 - 1) * d.cfg.feature_noise
            feats = feats + noise
        toks = F.pad(tokens[:, 1:], (0, k - 1))  # [B, S + K - 1]
        with self._autocast():
            outs = d.unroll(toks, feats[:, :s], k)
        head = d.target.head_weight.detach()
        final_pad = F.pad(final, (0, 0, 0, k))  # [B, W + K, H]
        j = torch.arange(s, device=self.device)
        total = rows.new_zeros(())
        acc = rows.new_zeros(())
        for st, out in enumerate(outs):
            out = out.float()  # [B, S, H]
            tgt_h = final_pad[:, 1 + st: 1 + st + s]  # [B, S, H] the feature of position j+1+s
            valid = (j[None, :] + 1 + st) < lengths[:, None]  # [B, S]
            n = valid.sum().clamp_min(1)
            if d.cfg.kind == "eagle1":
                sl1 = F.smooth_l1_loss(out, tgt_h, reduction="none").mean(-1)
                ce, agree = soft_cross_entropy(out.reshape(b * s, -1), tgt_h.reshape(b * s, -1), head,
                                               self.cfg.ce_chunk_elems)
                per = sl1 + self.cfg.ce_weight * ce.view(b, s)
                agree = agree.view(b, s)
            else:
                per, agree = self._eagle3_ce(out, tgt_h, head)
            if st == 0:
                acc = (agree & valid).sum() / n
            total = total + (self.cfg.ttt_decay ** st) * (per * valid).sum() / n
        return total, acc

    def _eagle3_ce(self, out: torch.Tensor, tgt_h: torch.Tensor, head: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, S, H] x2 -> soft-CE [B, S], top-1 agreement [B, S]
        """EAGLE-3: soft-CE over the draft vocab against the target distribution restricted to it."""
        d = self.drafter
        ids = d.draft_to_target(torch.arange(d.draft_vocab_size, device=self.device))
        with torch.no_grad():
            tgt_logits = F.linear(tgt_h, head.float())  # [B, S, V]
            tp = torch.softmax(tgt_logits.index_select(-1, ids), -1)
            truth = tgt_logits.argmax(-1)
        with self._autocast():
            dl = d.draft_logits(out)
        per = -(tp * torch.log_softmax(dl.float(), -1)).sum(-1)
        return per, d.draft_to_target(dl.argmax(-1)) == truth

    # ------------------------------------------------------------------------------------------------ loop
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One optimizer step on a sampled batch, queued without waiting for the device; returns its (loss, acc)
        as device scalars, or None when the buffer holds no training pair yet."""
        batch = self.buffer.sample(self.cfg.batch_size, self.cfg.window, self.generator, device=self.device)
        if batch is None:
            return None
        self.drafter.train()
        loss, acc = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        loss, acc = loss.detach(), acc.detach()
        self._loss_sum += loss
        self._acc_sum += acc
        self._n_since += 1
        return loss, acc

    def train(
        self,
        until: Callable[[], bool],  # True = stop at the next step boundary (the next phase needs the GPU)
        max_steps: int,  # cap on optimizer steps in this call
        idle_s: float | None = None,  # idle GPU seconds offered (None: this call's wall time)
        harvested: bool = True,  # False: training outside idle time (the step waits for it): not in used_gpu_s
    ) -> int:  # steps done; their device work has finished when this returns
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        queued: deque[torch.cuda.Event] = deque()
        done = 0
        t_first = 0.0
        while done < max_steps and not until():
            if done == 0:
                t_first = time.perf_counter()
            if self.train_step() is None:
                break
            done += 1
            if cuda:  # bound the queue: wait for an older step, the device still has the newer ones to run
                queued.append(torch.cuda.Event())
                queued[-1].record()
                if len(queued) > self.cfg.max_inflight:
                    queued.popleft().synchronize()
        if cuda:
            torch.cuda.synchronize(self.device)
        if done and harvested:
            self.used_gpu_s += time.perf_counter() - t_first
        self.idle_gpu_s += idle_s if idle_s is not None else time.perf_counter() - t0
        self.drafter.eval()
        return done

    def add_idle(self, seconds: float) -> None:
        """Account idle GPU time that was offered but not used by a `train` call (e.g. no data yet)."""
        self.idle_gpu_s += seconds

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """drafter/loss and drafter/acc averaged since the last reset; drafter/steps and harvest/*_total cumulative."""
        m: dict[str, float] = {
            mc.DRAFTER_STEPS: float(self.steps),
            mc.HARVEST_IDLE_TOTAL: self.idle_gpu_s,
            mc.HARVEST_USED_TOTAL: self.used_gpu_s,
        }
        if self._n_since:  # the one host read of the step metrics
            m[mc.DRAFTER_LOSS] = float(self._loss_sum) / self._n_since
            m[mc.DRAFTER_ACC] = float(self._acc_sum) / self._n_since
        if reset:
            self._loss_sum.zero_()
            self._acc_sum.zero_()
            self._n_since = 0
        return m

    # ------------------------------------------------------------------------------------------------ weights
    def snapshot(self) -> DrafterSnapshot:
        """A versioned copy of the trainable weights for the engine (loaded at the next rollout start)."""
        self.version += 1
        return DrafterSnapshot(self.version, self.drafter.trainable_state_dict())

    def state_dict(self) -> dict[str, Any]:
        """Exact-resume state (host tensors; the optimizer's are moved back to the parameters' device on load)."""
        return {
            "drafter": {k: v.cpu() for k, v in self.drafter.trainable_state_dict().items()},
            "optimizer": host_copy(self.optimizer.state_dict()),  # a snapshot, not the live moment tensors
            "generator": self.generator.get_state(),
            "noise_gen": self.noise_gen.get_state(),
            "steps": self.steps, "version": self.version,
            "idle_gpu_s": self.idle_gpu_s, "used_gpu_s": self.used_gpu_s,
            "metric_sums": (float(self._loss_sum), float(self._acc_sum), self._n_since),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.version = int(state["steps"]), int(state["version"])
        if "generator" in state:  # older checkpoints held weights, optimizer and counters only
            if state["generator"].numel() == self.generator.get_state().numel():
                self.generator.set_state(state["generator"])
            else:  # saved before window sampling moved to the buffer's device: a different generator kind
                log.warning("spot trainer: window-sampling generator state of another device kind; reseeded")
            self.noise_gen.set_state(state["noise_gen"])
            self.idle_gpu_s, self.used_gpu_s = float(state["idle_gpu_s"]), float(state["used_gpu_s"])
            loss_sum, acc_sum, self._n_since = state["metric_sums"]
            self._loss_sum.fill_(loss_sum)
            self._acc_sum.fill_(acc_sum)

    def save(self, path: Path | str) -> None:
        """Trainable parameters only (plus the step counter), as safetensors."""
        from safetensors.torch import save_file

        sd = {k: v.contiguous().cpu() for k, v in self.drafter.trainable_state_dict().items()}
        save_file(sd, str(path), metadata={"steps": str(self.steps), "kind": self.drafter.cfg.kind})

    def load(self, path: Path | str) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        sd = load_file(str(path), device=str(self.device))
        self.drafter.load_state_dict(sd, strict=True)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        self.steps = int(meta.get("steps", 0))


# ---------------------------------------------------------------------------------------------------- benchmark
H200_BEFORE_MS = 92.6  # bench/results/drafter_h200.json before this trainer: 185.2 s used / 2000 steps


def bench_step(
    device: str = "cpu",
    shape: str = "smollm2-135m",  # model preset whose width / vocab the drafter gets (random weights)
    batch: int = 16,  # windows per step (SpotTrainerConfig default)
    window: int = 128,  # rows per window
    steps: int = 10,  # timed steps (after `warmup` untimed ones)
    warmup: int = 3,
) -> dict[str, float]:
    """Milliseconds per spot-training step of an EAGLE-1 drafter on a buffer of random 256-row sequences."""
    from worker.tlt.model import preset, random_model

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = random_model(preset(shape, n_layers=1), device=dev, dtype=dtype)  # the drafter reads embed / head only
    drafter = EagleDrafter(target).to(dev)
    h, seq_len, n_seq = target.args.dim, 256, max(8, batch)
    buf = HiddenStateBuffer(h, n_seq * seq_len * (h * dtype.itemsize + 24), device=dev, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for i in range(n_seq):
        toks = torch.randint(target.args.vocab_size, (seq_len,), generator=g)
        buf.capture(torch.full((seq_len,), i), toks.to(dev), torch.randn(seq_len, h, generator=g).to(dev))
    tr = SpotTrainer(drafter, buf, SpotTrainerConfig(batch_size=batch, window=window))
    tr.train(lambda: False, warmup)
    t0 = time.perf_counter()
    tr.train(lambda: False, steps)
    ms = 1e3 * (time.perf_counter() - t0) / steps
    return {"ms_per_step": ms, "tokens_per_step": float(batch * (window - 1)), "loss": tr.metrics()[mc.DRAFTER_LOSS]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Time one spot-training step (EAGLE-1, random weights).")
    ap.add_argument("--bench", action="store_true", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ref-ms", type=float, default=None, help=f"peer ms/step (CUDA default: {H200_BEFORE_MS}, the "
                    "H200 figure before this trainer)")
    a = ap.parse_args(argv)
    r = bench_step(a.device, a.shape, a.batch, a.window, a.steps)
    ref = a.ref_ms if a.ref_ms is not None else (H200_BEFORE_MS if a.device.startswith("cuda") else None)
    ratio = f"{ref / r['ms_per_step']:.1f}x" if ref else "-"
    print(f"{'device':<8}{'shape':<16}{'B x W':>10}{'ms/step':>10}{'peer ms':>9}{'speedup':>9}{'tokens/s':>12}")
    print(f"{a.device:<8}{a.shape:<16}{f'{a.batch} x {a.window}':>10}{r['ms_per_step']:>10.2f}"
          f"{(f'{ref:.1f}' if ref else '-'):>9}{ratio:>9}{1e3 * r['tokens_per_step'] / r['ms_per_step']:>12.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
