"""The spot trainer: trains the drafter on the hidden-state buffer in GPU time the rollout's long tail leaves idle.

Loss (EAGLE-1, Li et al. 2024), on response-token rows only (the buffer holds nothing else):
    SmoothL1(predicted feature, target feature h_{j+1}) + 0.1 * soft-CE(drafter logits, softmax(target logits))
where the target logits come from the frozen head applied to h_{j+1}. EAGLE-3: soft-CE only, over the draft vocab
(the target distribution restricted to it and renormalised), summed over `ttt_steps` unrolled steps weighted 0.8^s.
`drafter/acc` is top-1 agreement of the first step with the target's argmax.

Preemptible: `train(until, max_steps)` runs small optimizer steps and checks `until()` between them, so it returns
at the next step boundary; every step is all-or-nothing (optimizer state and the step counter move together).
The engine never sees a half-trained drafter: `snapshot()` publishes a versioned copy of the trainable weights, and
the proposer loads it at the next rollout start. `save`/`load` move the trainable parameters only (safetensors);
`state_dict`/`load_state_dict` hold everything an exact resume needs (weights, AdamW state, the window-sampling and
feature-noise generators, counters), so a resumed run's next steps are bit-identical to the uninterrupted run's.

Metrics (`metrics()`): drafter/loss, drafter/acc, drafter/steps (cumulative), harvest/idle_gpu_s (idle GPU time
offered to the trainer), harvest/used_gpu_s (time its steps took), harvest/ratio.

Run the tests: `python -m pytest tests/drafter/test_drafter_train.py -q`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worker.tlt.drafter.buffer import Batch, HiddenStateBuffer
from worker.tlt.drafter.model import EagleDrafter

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


@dataclass(frozen=True)
class DrafterSnapshot:
    version: int  # increases with every publish
    state: dict[str, torch.Tensor]  # trainable parameters and buffers (detached copies)


def _host_copy(obj: Any) -> Any:
    """Nested state with every tensor copied to the host (a snapshot that later steps cannot change)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_host_copy(v) for v in obj)
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
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.learning_rate, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)  # window starts (CPU)
        self.noise_gen = torch.Generator(device=self.device).manual_seed(cfg.seed + 1)  # feature noise (device)
        self.steps = 0
        self.version = 0
        self.idle_gpu_s = 0.0
        self.used_gpu_s = 0.0
        self._loss_sum = self._acc_sum = 0.0
        self._n_since = 0

    # ------------------------------------------------------------------------------------------------ loss
    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:  # -> (loss, top-1 accuracy), scalars
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
        outs = d.unroll(toks, feats[:, :s], k)
        head = d.target.head_weight.detach().float()
        final_pad = F.pad(final, (0, 0, 0, k))  # [B, W + K, H]
        j = torch.arange(s, device=self.device)
        total = rows.new_zeros(())
        acc = rows.new_zeros(())
        for st, out in enumerate(outs):
            tgt_h = final_pad[:, 1 + st: 1 + st + s]  # [B, S, H] the feature of position j+1+s
            valid = (j[None, :] + 1 + st) < lengths[:, None]  # [B, S]
            n = valid.sum().clamp_min(1)
            tgt_logits = F.linear(tgt_h, head)  # [B, S, V]
            if d.cfg.kind == "eagle1":
                logits = d.draft_logits(out.float())
                sl1 = F.smooth_l1_loss(out.float(), tgt_h, reduction="none").mean(-1)
                ce = -(torch.softmax(tgt_logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
                per = sl1 + self.cfg.ce_weight * ce
                if st == 0:
                    acc = ((logits.argmax(-1) == tgt_logits.argmax(-1)) & valid).sum() / n
            else:
                ids = d.draft_to_target(torch.arange(d.draft_vocab_size, device=self.device))
                dl = d.draft_logits(out.float())
                tp = torch.softmax(tgt_logits.index_select(-1, ids), -1)
                per = -(tp * torch.log_softmax(dl, -1)).sum(-1)
                if st == 0:
                    pred = d.draft_to_target(dl.argmax(-1))
                    acc = ((pred == tgt_logits.argmax(-1)) & valid).sum() / n
            total = total + (self.cfg.ttt_decay ** st) * (per * valid).sum() / n
        return total, acc

    # ------------------------------------------------------------------------------------------------ loop
    def train_step(self) -> tuple[float, float] | None:
        """One optimizer step on a sampled batch; None when the buffer holds no training pair yet."""
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
        lv, av = float(loss.detach()), float(acc)  # one sync per step: the step boundary
        self._loss_sum += lv
        self._acc_sum += av
        self._n_since += 1
        return lv, av

    def train(
        self,
        until: Callable[[], bool],  # True = stop at the next step boundary (the next phase needs the GPU)
        max_steps: int,  # cap on optimizer steps in this call
        idle_s: float | None = None,  # idle GPU seconds offered (None: this call's wall time)
    ) -> int:  # steps done
        t0 = time.perf_counter()
        done = 0
        while done < max_steps and not until():
            ts = time.perf_counter()
            if self.train_step() is None:
                break
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.used_gpu_s += time.perf_counter() - ts
            done += 1
        self.idle_gpu_s += idle_s if idle_s is not None else time.perf_counter() - t0
        self.drafter.eval()
        return done

    def add_idle(self, seconds: float) -> None:
        """Account idle GPU time that was offered but not used by a `train` call (e.g. no data yet)."""
        self.idle_gpu_s += seconds

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """drafter/* averages since the last reset, harvest/* and drafter/steps cumulative."""
        m: dict[str, float] = {
            "drafter/steps": float(self.steps),
            "harvest/idle_gpu_s": self.idle_gpu_s,
            "harvest/used_gpu_s": self.used_gpu_s,
            "harvest/ratio": self.used_gpu_s / self.idle_gpu_s if self.idle_gpu_s > 0 else 0.0,
        }
        if self._n_since:
            m["drafter/loss"] = self._loss_sum / self._n_since
            m["drafter/acc"] = self._acc_sum / self._n_since
        if reset:
            self._loss_sum = self._acc_sum = 0.0
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
            "optimizer": _host_copy(self.optimizer.state_dict()),  # a snapshot, not the live moment tensors
            "generator": self.generator.get_state(),
            "noise_gen": self.noise_gen.get_state(),
            "steps": self.steps, "version": self.version,
            "idle_gpu_s": self.idle_gpu_s, "used_gpu_s": self.used_gpu_s,
            "metric_sums": (self._loss_sum, self._acc_sum, self._n_since),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.version = int(state["steps"]), int(state["version"])
        if "generator" in state:  # older checkpoints held weights, optimizer and counters only
            self.generator.set_state(state["generator"])
            self.noise_gen.set_state(state["noise_gen"])
            self.idle_gpu_s, self.used_gpu_s = float(state["idle_gpu_s"]), float(state["used_gpu_s"])
            self._loss_sum, self._acc_sum, self._n_since = state["metric_sums"]

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
