"""`OnlineDrafter`: the adaptive drafter wired into the RL loop (buffer + capture + spot trainer + engine proposer).

    od = OnlineDrafter(drafter_config(spec), policy)     # EAGLE-1 or -3 (job_spec_translate.py; warm start if given)
    engine = Engine(policy, config=EngineConfig(..., capture_layers=od.capture_layers), controller=...,
                    proposers={"eagle": od.proposer}, hidden_hook=od.hidden_hook)
    per RL step:  od.begin_rollout(step)                # newest published weights -> engine; new buffer step
                  out = engine.generate(...); od.observe_rollout(out)   # tail seconds = idle GPU time offered
                  ... reward, update, weight sync ...
                  metrics = od.after_update(step, trajs)              # spot training (rl/trainer.py DrafterHook)
    od.train_in_tail(until, max_steps)                   # for an engine that interleaves training with tail steps

Hook rows: EAGLE-1 reads the final-norm hidden [N, H]; EAGLE-3 needs the engine built with
`capture_layers=od.capture_layers` (its three feature layers), whose hook rows are cat(g_2, g_{L//2}, g_{L-3},
final) [N, 4H]: the buffer stores them whole (the first 3H columns are the drafter's input features, the last H the
target hidden whose head gives the soft-CE target), the proposer keeps the first 3H.
Per RL step, `harvest/idle_gpu_s` is the wall time of the rollout's tail: its decode steps whose active batch was
below `rollout.sd_on_below` (memory-bound, the GPU's compute mostly idle) plus the drafter steps the engine ran
between them (`train_in_tail`); `harvest/used_gpu_s` is those drafter steps, so `harvest/ratio` <= 1. Training that
`after_update` runs to finish the step's budget is not harvested: the step waits for it (timing_s/drafter). The
cumulative counters are `harvest/{idle,used}_gpu_s_total`.

Exact resume: `state_dict()` holds the spot trainer's state (trainable weights, AdamW, its generators, counters), the
buffer's live rows (the last two steps' hidden states: a resumed run trains on the same windows), the weights and
version the engine is serving, the proposer's sampling generator and the capture's rollout counter. rl/checkpoint.py
stores it under extra["drafter"]; after `load_state_dict` the next RL step's drafter updates are bit-identical to the
uninterrupted run's (tests/drafter/test_drafter_resume.py).

Run the tests: `python -m pytest tests/drafter/test_drafter_online.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from worker.tlt import metric_catalog as mc
from worker.tlt.file_guard import current as file_guard
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.types import GenerationOutput
from worker.tlt.speculative.control.switch import in_tail
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.export import load_exported
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.drafter.online_config import OnlineDrafterConfig
from worker.tlt.speculative.drafter.spot_trainer import SpotTrainer, SpotTrainerConfig


def build_drafter(config: OnlineDrafterConfig, target: Transformer) -> EagleDrafter:
    """A fresh drafter of the configured kind (or the warm-start directory's weights), on the target's device."""
    ttt = 3 if config.kind == "eagle3" else 1
    if config.warm_start_dir:
        # every file of the directory must stay inside the allowed roots (worker/tlt/file_guard.py)
        return load_exported(file_guard().tree(config.warm_start_dir), target, ttt_steps=ttt)
    cfg = EagleConfig(kind=config.kind, ttt_steps=ttt)
    return EagleDrafter(target, cfg).to(target.head_weight.device)


class OnlineDrafter:
    def __init__(self, config: OnlineDrafterConfig, target: Transformer,
                 proposer_config: EagleProposerConfig | None = None) -> None:
        self.config = config
        dev = target.head_weight.device
        self.train_drafter = build_drafter(config, target)
        # the engine's copy runs in the target's dtype (bf16 on GPU: the shared head is read as is, not cast per
        # draft step); the trained copy stays fp32 and snapshots are cast on load
        serve = EagleDrafter(target, self.train_drafter.cfg).to(dev, target.head_weight.dtype)
        serve.load_state_dict(self.train_drafter.state_dict())
        buf_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        self.buffer = HiddenStateBuffer(self.row_width, int(config.buffer_gb * 2**30), device=dev,
                                        dtype=buf_dtype)
        self.capture = EngineCapture(self.buffer)
        self.trainer = SpotTrainer(self.train_drafter, self.buffer,
                                   SpotTrainerConfig(learning_rate=config.learning_rate, seed=config.seed))
        self.proposer = EagleProposer(serve, proposer_config or EagleProposerConfig())
        self._published_at = 0  # trainer step count of the last snapshot
        self._steps_this_rl_step = 0
        self._tail_s = 0.0  # idle time offered by the last rollout, not yet accounted
        self._tail_used_s = 0.0  # drafter training between the last rollout's tail steps, not yet accounted
        self._rollouts = 0  # training rollouts begun: the buffer's step numbers (checkpointed with the buffer)
        self.token_counts = torch.zeros(target.args.vocab_size, dtype=torch.int64)  # response tokens seen, per id

    # ------------------------------------------------------------------------------------------------ engine side
    @property
    def capture_layers(self) -> tuple[int, ...]:
        """EngineConfig.capture_layers this drafter needs: () for EAGLE-1, its three feature layers for EAGLE-3."""
        return self.train_drafter.feature_layers

    @property
    def row_width(self) -> int:
        """Floats per hook row: H (EAGLE-1) or 3H features + the final hidden H (EAGLE-3)."""
        d = self.train_drafter
        return d.feature_dim + (d.args.dim if d.feature_layers else 0)

    def hidden_hook(self, seq_ids: list[tuple[int, int]], token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """`Engine(hidden_hook=...)`: rows go to the training buffer and to the proposer's feature rings."""
        if hidden.shape[-1] != self.row_width:
            raise ValueError(f"hook rows of width {hidden.shape[-1]}, the {self.train_drafter.cfg.kind} drafter needs "
                             f"{self.row_width}: build the engine with capture_layers={self.capture_layers}")
        self.capture(seq_ids, token_ids, hidden)
        self.proposer.observe(seq_ids, token_ids, hidden)

    def begin_rollout(self, step: int) -> None:
        """Before `engine.generate` of a training rollout: publish trained weights to the engine, open a buffer step.
        `step` is the caller's RL step, for its own bookkeeping: the buffer numbers rollouts itself, so its "last two
        steps" survive a resume even when the caller's rollout counter restarts."""
        if self.trainer.steps != self._published_at:
            self.proposer.load_snapshot(self.trainer.snapshot())
            self._published_at = self.trainer.steps
        self._pick_draft_vocab()
        self.buffer.begin_step(self._rollouts)
        self._rollouts += 1
        self.capture.reset()
        self.proposer.reset()
        self._steps_this_rl_step = 0

    def _pick_draft_vocab(self) -> None:
        """config.draft_vocab_size (EAGLE-1): the most frequent tokens of all responses so far become the
        proposer's draft vocabulary, re-picked at every rollout start (in place: captured graphs stay valid)."""
        n, d = self.config.draft_vocab_size, self.train_drafter
        if d.cfg.kind == "eagle1" and 0 < n < d.args.vocab_size and int(self.token_counts.sum()) > 0:
            self.proposer.set_draft_vocab(torch.topk(self.token_counts.float(), n).indices)

    def observe_rollout(self, out: GenerationOutput) -> float:
        """Tail seconds of a finished rollout (steps in the tail: speculative/control/switch.in_tail); its response
        tokens join the counts the draft vocabulary is picked from."""
        toks = [t for s in out.sequences for t in s.tokens]
        if toks:
            self.token_counts += torch.bincount(torch.tensor(toks), minlength=self.token_counts.numel())[
                : self.token_counts.numel()]
        tail = sum(s.seconds for s in out.steps if s.kind != "prefill" and in_tail(s.active, self.config.tail_below))
        self._tail_s += tail
        return tail

    def train_in_tail(self, until: Callable[[], bool], max_steps: int) -> int:
        """Spot steps between tail decode steps (idle time is accounted from `observe_rollout`)."""
        cap = self.config.max_train_steps_per_rl_step - self._steps_this_rl_step
        before = self.trainer.used_gpu_s
        n = self.trainer.train(until, min(max_steps, max(cap, 0)), idle_s=0.0)
        self._tail_used_s += self.trainer.used_gpu_s - before
        self._steps_this_rl_step += n
        return n

    # ------------------------------------------------------------------------------------------------ trainer side
    def after_update(self, step: int, trajectories: Sequence[Any]) -> dict[str, float]:
        """rl/trainer.py's DrafterHook: the rest of this RL step's spot-training budget (in the step's own time, not
        harvested; unless config.train_after_update is off), then drafter/* and this step's harvest/* (module
        docstring)."""
        if self.config.train_after_update:
            budget = self.config.max_train_steps_per_rl_step - self._steps_this_rl_step
            self._steps_this_rl_step += self.trainer.train(lambda: False, max(budget, 0), idle_s=0.0,
                                                           harvested=False)
        idle, used = self._tail_s + self._tail_used_s, self._tail_used_s
        self.trainer.add_idle(idle)
        self._tail_s = self._tail_used_s = 0.0
        return {**self.trainer.metrics(), mc.HARVEST_IDLE: idle, mc.HARVEST_USED: used,
                mc.HARVEST_RATIO: used / idle if idle > 0 else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {
            "trainer": self.trainer.state_dict(),
            "buffer": self.buffer.state_dict(),
            "serving": {k: v.cpu() for k, v in self.proposer.drafter.trainable_state_dict().items()},
            "serving_version": self.proposer.version,
            "proposer_gen": self.proposer.gen.get_state(),
            "capture_epoch": self.capture.epoch,
            "published_at": self._published_at,
            "steps_this_rl_step": self._steps_this_rl_step,
            "tail_s": self._tail_s,
            "tail_used_s": self._tail_used_s,
            "rollouts": self._rollouts,
            "draft_vocab": self.proposer.draft_vocab,
            "token_counts": self.token_counts.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "trainer" not in state:  # an older checkpoint: weights, optimizer and counters only; publish them
            self.trainer.load_state_dict(state)
            self.proposer.load_snapshot(self.trainer.snapshot())
            self._published_at = self.trainer.steps
            return
        self.trainer.load_state_dict(state["trainer"])
        self.buffer.load_state_dict(state["buffer"])
        self.proposer.drafter.load_state_dict(state["serving"], strict=True)
        self.proposer.version = int(state["serving_version"])
        self.proposer.gen.set_state(state["proposer_gen"])
        self.capture.epoch = int(state["capture_epoch"])
        self._published_at = int(state["published_at"])
        self._steps_this_rl_step = int(state["steps_this_rl_step"])
        self._tail_s = float(state["tail_s"])
        self._tail_used_s = float(state.get("tail_used_s", 0.0))  # 0 between RL steps
        self._rollouts = int(state["rollouts"])
        self.token_counts = state.get("token_counts", torch.zeros_like(self.token_counts)).clone()
        vocab = state.get("draft_vocab")
        self.proposer.set_draft_vocab(vocab.to(self.proposer.device) if vocab is not None else None)
