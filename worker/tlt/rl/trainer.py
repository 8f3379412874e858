"""The TLT RL step: rollout -> rewards -> advantages -> policy update -> weight sync -> drafter spot training in the
tail. The advantage estimator and the policy loss are the job's `Algorithm` (rl/algorithms/: grpo, dapo, dr_grpo,
gspo, rloo, reinforce_plus_plus or an installed one), looked up by name; the step never branches on it.

    trainer = GRPOTrainer(spec, model, tokenizer, rollout, train_prompts, reward_fns, device=...)
    metrics, samples, hist = trainer.step()       # one RL step; metric names: metric_catalog.py
    trainer.state_dict() / trainer.load_state_dict(...)   # via rl/checkpoint.py

How this departs from the GRPO paper (Shao et al. 2024), beyond the algorithm's own choices listed in
rl/algorithms/builtin.py:
- One policy update per rollout (TRL's num_iterations = 1, as DAPO and Dr.GRPO run it): old log-probs are the
  trainer's own recompute (detached), so ratio = 1 in value and the gradient is the plain policy gradient; the
  engine's log-probs are only compared (`rollout/logp_abs_diff`, `rollout/ppl_ratio`), never trained on.
- Dynamic sampling (DAPO) drops zero-variance groups from the update without drawing replacement prompts, so an
  update may use fewer than prompts_per_step groups (`actor/num_groups_used`); a step whose groups all drop skips
  the optimizer step (the LR schedule still advances).
- Rewards are scored as sequences finish (rewards/streaming.py: a worker thread decodes and scores each response
  the engine reports finished while the rest still decode); `timing_s/reward` is only what is left after the
  rollout returns, `timing_s/reward_work` the whole scoring time, mostly overlapped. The overlong penalty (DAPO) is
  added to the weighted reward sum when overlong_buffer > 0.
- bf16/fp16 models train through fp32 master weights by default (rl/optim.py `MasterWeights`), so the update the
  engine sees is the fp32 optimizer's, rounded once.
- The update runs on torch AdamW in this process or on DeepSpeed's engine (ZeRO stages, optimizer offload), as
  `resources` asks or as the memory arithmetic decides (rl/update_plan.py, rl/deepspeed_update.py); `self.plan` says
  which. DeepSpeed clips by the global norm, keeps its own fp32 master weights, and at ZeRO-3 the sync phase gathers
  its partitioned weights into the engine's copy.
- Weight sync is free: the rollout engine runs the very module being trained (colocated), so the update is visible
  to the next rollout with no copy; `timing_s/sync` measures only the engine's notification hook.
- With `rollout.release_kv_for_update` the rollout frees the engine's KV cache (and its CUDA graphs) as it returns,
  so the update runs with that memory; the next rollout allocates it again (rl/engine_adapter.py).
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.data.sampler import PromptSampler
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rewards.registry import RewardFn
from worker.tlt.rewards.shaping import overlong_penalty
from worker.tlt.rewards.streaming import StreamingScorer
from worker.tlt.rl.algorithms.base import AdvantageInput, BatchSums, LossNorm, local_sums, zero_std_groups
from worker.tlt.rl.algorithms.registry import resolve
from worker.tlt.rl.batch import MicroBatch, UpdateSeq, micro_batches
from worker.tlt.rl.deepspeed_update import DeepSpeedUpdate, build_update
from worker.tlt.rl.logprobs import token_logprobs_entropy
from worker.tlt.rl.optim import (
    MasterWeights,
    build_optimizer,
    build_scheduler,
    trainable_params,
    use_master_weights,
)
from worker.tlt.rl.policy_forward import ResponseLogits
from worker.tlt.rl.rollout_io import Rollout, Trajectory
from worker.tlt.rl.update_plan import UpdatePlan

log = logging.getLogger(__name__)


class DrafterHook(Protocol):
    """Drafter spot training in the tail. Called once per RL step after the weight sync; returns its
    metrics (drafter/*, harvest/*) and must be preemptible. No hook configured = nothing runs (no metrics)."""

    def after_update(self, step: int, trajectories: Sequence[Trajectory]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def length_stats(lengths: np.ndarray, clipped: np.ndarray) -> dict[str, float]:
    """response_length/* metrics (verl names) of lengths [N] and their max-length flags [N]."""
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/p50": float(np.percentile(lengths, 50)),
        "response_length/p90": float(np.percentile(lengths, 90)),
        "response_length/clip_ratio": float(clipped.mean()),
    }


def length_histogram(lengths: np.ndarray, max_len: int, bins: int = 64) -> tuple[list[float], list[int]]:
    """The whole response-length distribution: `bins` equal bins over [0, max_len] (fewer when max_len is small)."""
    nb = max(1, min(bins, max_len))
    counts, edges = np.histogram(lengths, bins=nb, range=(0, max_len))
    return [float(e) for e in edges], [int(c) for c in counts]


class GRPOTrainer:
    def __init__(
        self,
        spec: JobSpec,
        model: Transformer,
        tokenizer: TokenizerLike,
        rollout: Rollout,
        train_prompts: list[RenderedPrompt],
        reward_fns: list[RewardFn],
        device: torch.device | str = "cpu",
        drafter: DrafterHook | None = None,
        num_samples: int = 2,
        reward_names: list[str] | None = None,  # names of reward_fns for metrics (default: algorithm.reward_funcs)
        update: tuple[UpdatePlan, DeepSpeedUpdate | None] | None = None,  # rl/deepspeed_update.py build_update;
        # None = built here (after the rollout engine: its CUDA graphs are then dropped if DeepSpeed moved weights)
    ) -> None:
        self.spec, self.algo = spec, spec.algorithm
        self.algorithm = resolve(spec.algorithm.algorithm_name)  # advantages + policy loss (rl/algorithms/)
        # batch-wide advantage statistics: this process's batch is the step's, unless data parallelism sums the
        # ranks' shards (multigpu/data_parallel.py)
        self.batch_sums: BatchSums = local_sums
        self.model, self.tokenizer, self.rollout = model, tokenizer, rollout
        self.reward_fns, self.device, self.drafter = reward_fns, device, drafter
        self.reward_names = reward_names or list(spec.algorithm.reward_funcs)
        self.num_samples = num_samples  # sample rows reported per step
        self.sampler: PromptSampler[RenderedPrompt] = PromptSampler(train_prompts, seed=spec.seed)
        self.generator = rollout.generator  # the rollout's sampling stream (checkpointed)
        self.ref_model = None
        if self.algo.beta > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.plan, self.ds = update if update is not None else build_update(spec, model, torch.device(device))
        if not self.plan.fits and torch.device(device).type == "cuda":
            log.warning("the policy update may not fit: %s", "; ".join(self.plan.lines()))
        elif not self.plan.fits:  # on CPU the plan's budgets are host memory and its activations a worst case
            log.info("policy update on the CPU: estimated peak %.1f GB of %.1f GB host memory (an upper bound)",
                     self.plan.gpu_bytes / 1e9, self.plan.gpu_budget / 1e9)
        # a drafter fed from the update's forward (the vLLM backend's) captures its hidden states there
        self.policy_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ResponseLogits(
            model, capture=getattr(drafter, "update_capture", None))
        if self.ds is not None:
            self.master = MasterWeights(trainable_params(model), enabled=False)  # DeepSpeed keeps its own
            self.optimizer: torch.optim.Optimizer = self.ds.base_optimizer
            self.policy_logits = self.ds.forward
            engine = getattr(rollout, "engine", None)
            if update is None and self.ds.moved_storage and engine is not None:  # graphs on the old storage
                engine.release_memory()
                engine.restore_memory()
        else:
            self.master = MasterWeights(trainable_params(model), enabled=use_master_weights(model, self.algo))
            self.optimizer = build_optimizer(self.master.train_params, self.algo)
        self.scheduler = build_scheduler(self.optimizer, self.algo, total_steps=spec.max_steps)
        self.scorer = StreamingScorer(tokenizer, reward_fns, self.algo.reward_weights)
        self.step_count = 0  # RL steps completed

    # ------------------------------------------------------------------------------------------------ phases
    def on_finish(self, index: int, traj: Trajectory) -> None:
        """The rollout's callback: queue the finished response for scoring (runs while the rest decode)."""
        self.scorer.submit(index, traj.response, traj.prompt.example.answer)

    def score(self, trajs: Sequence[Trajectory]) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards [N] (weighted sum + overlong penalty) and per-function means, from the scores queued during the
        rollout (any response the rollout did not report is scored here)."""
        for i, t in enumerate(trajs):
            if not self.scorer.submitted(i):
                self.on_finish(i, t)
        texts, scored, busy_s = self.scorer.collect(len(trajs))
        totals = []
        for (total, _), t in zip(scored, trajs, strict=True):
            pen = overlong_penalty(len(t.response), self.algo.max_completion_length, self.algo.overlong_buffer)
            totals.append(total + pen)
        metrics = {"timing_s/reward_work": busy_s}
        for k, name in enumerate(self.reward_names):
            metrics[f"reward/{name}/mean"] = float(np.mean([parts[k] for _, parts in scored]))
        self._last_texts, self._last_parts = texts, [parts for _, parts in scored]
        return torch.tensor(totals, dtype=torch.float32), metrics

    def response_logprobs(
        self, policy_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mb: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [b, S-1], zero off the mask; entropies [n] of the n response positions, no grad).
        `policy_logits` is rl/policy_forward.py's ResponseLogits (or DeepSpeed's engine around it); the head and the
        softmax run on response positions only, gathered by the host-made index so nothing waits on the GPU."""
        b, s = mb.input_ids.shape
        idx = mb.resp_index  # [n] positions in the [b, S-1] grid
        at = idx + idx // (s - 1)  # [n] the same positions in the [b, S] grid: row i, column j is i * S + j
        logits = policy_logits(mb.input_ids, at)  # [n, V]
        targets = mb.input_ids.reshape(-1).index_select(0, at + 1)  # [n] the next token of each position
        lp, ent = token_logprobs_entropy(logits, targets, self.algo.temperature)
        logp = torch.zeros(b * (s - 1), dtype=lp.dtype, device=lp.device).index_copy(0, idx, lp)
        return logp.view(b, s - 1), ent

    def update(self, seqs: list[UpdateSeq]) -> dict[str, float]:
        """One optimizer step over `seqs` in micro-batches; returns actor/* and rollout/* metrics. Metric sums stay
        on the device until one read at the end, so the host queues micro-batches without waiting for the GPU."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.model.train()
        if self.ds is not None:  # ZeRO-3 trains a copy, built while the rollout engine held the model in eval mode:
            self.ds.train_model.train()  # without this, gradient checkpointing never engages (a 7B forward OOMs)
        names = ("loss", "entropy", "kl", "clip", "tokens", "lp_diff", "lp_diff_max", "lp_sum_train", "lp_sum_roll",
                 "lp_tokens", "grad_norm")
        acc = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in names}  # float64 sums
        if seqs:
            norm = LossNorm.of_lengths([len(s.response_ids) for s in seqs])
            if self.ds is None:
                self.optimizer.zero_grad(set_to_none=True)
            mbs = list(micro_batches(seqs, self.algo.micro_batch_tokens, self.tokenizer.pad_id, self.device))
            ref_logits = ResponseLogits(self.ref_model) if self.ref_model is not None else None
            for i, mb in enumerate(mbs):
                logp, ent = self.response_logprobs(self.policy_logits, mb)
                ref_logp = None
                if ref_logits is not None:
                    with torch.no_grad():
                        ref_logp, _ = self.response_logprobs(ref_logits, mb)
                loss, st = self.algorithm.loss(logp, logp.detach(), mb.advantages, mb.mask, self.algo, norm, ref_logp)
                if self.ds is not None:  # DeepSpeed reduces and accumulates; the last micro-batch closes the step
                    self.ds.backward(loss, last=i == len(mbs) - 1)
                else:
                    loss.backward()
                    self.master.accumulate_grads()  # fp32 copies' grads (no-op without master weights)
                with torch.no_grad():
                    m = mb.mask
                    acc["loss"] += loss.detach()
                    acc["entropy"] += ent.sum()
                    acc["kl"] += st["kl_sum"]
                    acc["clip"] += st["clip_low_tokens"] + st["clip_high_tokens"]
                    acc["tokens"] += m.sum()
                    if mb.rollout_logp is not None:
                        d = (logp.detach() - mb.rollout_logp).abs() * m
                        acc["lp_diff"] += d.sum()
                        acc["lp_diff_max"] = torch.maximum(acc["lp_diff_max"], d.max())
                        acc["lp_sum_train"] += (logp.detach() * m).sum()
                        acc["lp_sum_roll"] += (mb.rollout_logp * m).sum()
                        acc["lp_tokens"] += m.sum()
                del logp, ent
            if self.ds is not None:
                acc["grad_norm"] += self.ds.step()  # clipped by DeepSpeed by the global norm, which it returns
            else:
                acc["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.master.train_params, self.algo.max_grad_norm)
                self.optimizer.step()
                self.master.write_back()  # the engine's weights := the fp32 step, rounded (no-op without masters)
                self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped update still advances the schedule (one LR per RL step)
            warnings.filterwarnings("ignore", message="Detected call of")
            self.scheduler.step()
        self.model.eval()
        sums = torch.stack([acc[k].to(self.device, torch.float64) for k in names]).tolist()  # the one host sync
        stats = dict(zip(names, sums, strict=True))
        tokens = max(stats["tokens"], 1.0)
        out = {
            "actor/pg_loss": stats["loss"],
            "actor/entropy": stats["entropy"] / tokens,
            "actor/kl": stats["kl"] / tokens,
            "actor/grad_norm": stats["grad_norm"],
            "actor/clipfrac": stats["clip"] / tokens,
            "actor/lr": lr,
        }
        if stats["lp_tokens"] > 0:
            n = stats["lp_tokens"]
            out["rollout/logp_abs_diff"] = stats["lp_diff"] / n
            out["rollout/logp_abs_diff_max"] = stats["lp_diff_max"]
            # exp(mean train logp - mean rollout logp): 1.0 when trainer and engine agree
            out["rollout/ppl_ratio"] = float(np.exp((stats["lp_sum_roll"] - stats["lp_sum_train"]) / n))
        return out

    # ------------------------------------------------------------------------------------------------ the step
    def step(self) -> tuple[dict[str, float], list[dict], tuple[list[float], list[int]]]:
        """One RL step. Returns (metrics, sample rows, response-length histogram (edges, counts))."""
        algo, g = self.algo, self.algo.num_generations
        t_step = time.perf_counter()
        prompts = self.sampler.next_batch(algo.prompts_per_step)

        t0 = time.perf_counter()  # 1. rollout (each response queued for scoring as it finishes)
        self.scorer.clear()
        trajs, sd_metrics = self.rollout(prompts, g, False, on_finish=self.on_finish)
        t_gen = time.perf_counter() - t0

        t0 = time.perf_counter()  # 2. rewards
        rewards, reward_metrics = self.score(trajs)
        lengths_t = torch.tensor([len(t.response) for t in trajs])
        adv = self.algorithm.advantages(AdvantageInput(rewards, g, lengths_t, self.batch_sums), algo)  # [N]
        zero_std = zero_std_groups(rewards, g)  # [P]
        t_reward = time.perf_counter() - t0

        t0 = time.perf_counter()  # 3. update (the engine's KV cache already freed with rollout.release_kv_for_update)
        keep = ~zero_std if algo.dynamic_sampling else torch.ones_like(zero_std)
        seqs = [
            UpdateSeq(t.prompt.ids, t.response, float(adv[i]), t.logprobs)
            for i, t in enumerate(trajs)
            if keep[i // g] and len(t.response) > 0
        ]
        actor = self.update(seqs)
        t_update = time.perf_counter() - t0

        t0 = time.perf_counter()  # 4. weight sync: colocated, the engine runs this module (see docstring)
        self.sync_weights()
        t_sync = time.perf_counter() - t0

        t0 = time.perf_counter()  # 5. drafter spot training in the tail (no-op when no drafter is configured)
        drafter_metrics = self.drafter.after_update(self.step_count + 1, trajs) if self.drafter is not None else {}
        t_drafter = time.perf_counter() - t0

        self.step_count += 1
        lengths = np.array([len(t.response) for t in trajs], dtype=np.float64)
        clipped = np.array([t.finish_reason == "length" for t in trajs], dtype=np.float64)
        metrics: dict[str, float] = {
            **length_stats(lengths, clipped),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "frac_reward_zero_std": float(zero_std.float().mean()),
            **reward_metrics,
            **actor,
            "actor/num_groups_used": float(keep.sum()),
            "timing_s/gen": t_gen,
            "timing_s/reward": t_reward,
            "timing_s/update": t_update,
            "timing_s/sync": t_sync,
            "timing_s/drafter": t_drafter,
            "timing_s/step": time.perf_counter() - t_step,
            "perf/tokens_per_s": float(lengths.sum()) / max(t_gen, 1e-9),
            **sd_metrics,
            **drafter_metrics,
        }
        samples = [
            {
                "prompt": trajs[i].prompt.text[-2000:],
                "response": self._last_texts[i][:4000],
                "reward": float(rewards[i]),
                "advantage": float(adv[i]),
                "length": len(trajs[i].response),
                "finish_reason": trajs[i].finish_reason,
                "answer": trajs[i].prompt.example.answer[-500:],
            }
            for i in range(0, min(len(trajs), self.num_samples * g), g)  # the first response of each group
        ][: self.num_samples]
        return metrics, samples, length_histogram(lengths, algo.max_completion_length)

    def sync_weights(self) -> None:
        """The update's weights into the rollout engine: nothing to copy when the engine runs the trained module;
        DeepSpeed's ZeRO-3 partitions gathered into the engine's copy one tensor at a time (every rank calls it)."""
        if self.ds is not None:
            self.ds.sync_engine_weights()
        self.rollout.on_weights_updated()

    def validate(self, val_prompts: list[RenderedPrompt]) -> dict[str, float]:
        """pass@1 with greedy decoding on the validation prompts: the fraction whose first reward function scores 1,
        and the mean weighted reward."""
        if not val_prompts:
            return {}
        t0 = time.perf_counter()
        self.scorer.clear()
        trajs, _ = self.rollout(val_prompts, 1, True, on_finish=self.on_finish)
        rewards, _ = self.score(trajs)
        return {
            "val/pass@1": float(np.mean([parts[0] >= 1.0 for parts in self._last_parts])),
            "val/reward_mean": float(rewards.mean()),
            "val/response_length_mean": float(np.mean([len(t.response) for t in trajs])),
            "timing_s/val": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Trainer state beyond the weights, optimizer, scheduler and RNG (those go to checkpoint.py directly)."""
        return {"step_count": self.step_count, "sampler": self.sampler.state_dict()}

    def close(self) -> None:
        """Stop the scoring thread."""
        self.scorer.close()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.sampler.load_state_dict(state["sampler"])
