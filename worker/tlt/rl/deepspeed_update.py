"""The policy update on DeepSpeed's engine: ZeRO stages 0-3 (a bf16 model at stage 0 takes DeepSpeed's replicated
path, which accumulates gradients in bf16; the plan uses stage 1 on one GPU instead), bf16 weights trained through fp32
master weights, optimizer state offload to the host (DeepSpeed's CPU Adam, JIT-built on first use; at stage 3 a share
of it, `resources.offload_ratio`, rl/partial_offload.py), and the weight flow from DeepSpeed's (possibly partitioned)
parameters into the rollout engine.

    plan, ds = build_update(spec, model, device)           # before the rollout engine captures its CUDA graphs
                                                           # (every rank, after the process group exists, or alone)
    for i, mb in enumerate(mbs): ds.backward(loss_of(ds.policy_logits(mb.input_ids, at)), last=i == len(mbs) - 1)
    grad_norm = ds.step(); ds.sync_engine_weights()        # once per RL step
    ds.save(root, step) / ds.load(root, step)              # every rank: each writes / reads its own shard

Weights the rollout engine reads: at stages 0-2 the engine runs the very module DeepSpeed trains (its bf16
parameters are whole on every rank, and DeepSpeed's optimizer writes the rounded fp32 step into them in place), so
there is nothing to copy. DeepSpeed re-points those parameters into its flat buffers when it starts, so it must
start before anything captures the weights' addresses (the engine's and the EAGLE proposer's CUDA graphs):
build.py builds it before the rollout; a trainer handed an engine built earlier sees `moved_storage` and drops the
engine's graphs (rl/trainer.py).
At stage 3 the trained module is a copy whose parameters DeepSpeed partitions across ranks; after each step every
parameter is gathered on the device one at a time (`GatheredParameters`) and copied into the engine's whole copy:
no full copy of the model on the host, at most one gathered tensor at a time on the device.

The learning rate: DeepSpeed steps the optimizer it was given (torch AdamW, fused on CUDA, or DeepSpeedCPUAdam with
offload), reading `lr` from that optimizer's param groups, so the trainer's LambdaLR drives `base_optimizer`.
Gradient clipping is DeepSpeed's (`gradient_clipping`: the global norm across ranks and partitions). Micro-batches
accumulate with DeepSpeed's gradient-accumulation boundary set by the caller (the number of micro-batches varies
per RL step); gradients are averaged over ranks, so a data-parallel caller scales each rank's loss by
`loss_scale()`, handed in at construction (its share of the global normaliser x world; multigpu/data_parallel.py).

DeepSpeed runs on CPU too (DS_ACCELERATOR=cpu, gloo): the CI tests train a tiny fp32 model on 2 processes.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from worker.tlt.config import AlgorithmConfig, JobSpec
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.optim import LOW_PRECISION, MasterWeights, adamw_kwargs, trainable_params
from worker.tlt.rl.partial_offload import gpu_share_state, load_gpu_share_state, sync_hyperparams
from worker.tlt.rl.policy_forward import ResponseLogits
from worker.tlt.rl.update_plan import UpdatePlan, count_params, plan_update


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_for(spec: JobSpec, model: Transformer, device: torch.device) -> UpdatePlan:
    """The update plan of `spec` for `model` on this process's device and host (world from the process group)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    host = host_memory_bytes()
    gpu = float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else host
    # an unset kv_cache_gb is planned after the update, around its peak (job_spec_translate.free_for_kv)
    kv_gb = spec.rollout.kv_cache_gb
    kv = 0.0 if spec.rollout.release_kv_for_update or device.type != "cuda" or kv_gb is None else kv_gb * 2**30
    low = any(p.dtype in LOW_PRECISION for p in trainable_params(model))
    return plan_update(spec.resources, spec.algorithm, model.args, count_params(model.args), world=world,
                       gpu_bytes=gpu, host_bytes=host, low_precision=low, kv_cache_bytes=kv,
                       deepspeed_installed=deepspeed_installed(), on_gpu=device.type == "cuda")


SUB_GROUPS = 40  # ZeRO-3 partial offload: optimizer sub-groups per rank, the grain of the GPU / host split


def ds_config(plan: UpdatePlan, algo: AlgorithmConfig, low_precision: bool, n_params: int = 0) -> dict[str, Any]:
    """DeepSpeed's config for `plan`: one sample per micro-step (the trainer's micro-batches are token-budgeted,
    the accumulation boundary is set per step), global-norm clipping, fp32 gradient accumulation under bf16.
    Partial offload splits the optimizer's sub-groups (DeepSpeed's default holds 1e9 elements: 7 for a 7B model),
    so `n_params` (the trained parameters) sizes them to about SUB_GROUPS per rank."""
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": plan.pin_host}
        if plan.offload_ratio < 1:
            world = dist.get_world_size() if dist.is_initialized() else 1
            zero["offload_optimizer"]["ratio"] = plan.offload_ratio
            zero["sub_group_size"] = max(1, -(-n_params // (world * SUB_GROUPS)))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": algo.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed steps any torch optimizer
        "steps_per_print": 1 << 30,  # no throughput lines in the job log
    }
    if low_precision:
        cfg["bf16"] = {"enabled": True}
        if plan.zero_stage > 0:  # stage 0 bf16 is DeepSpeed's DDP path, which accumulates in bf16
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def ensure_process_group(backend: str) -> None:
    """DeepSpeed needs a process group; a single-process job gets a world of one on a free local port."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def build_update(spec: JobSpec, model: Transformer, device: torch.device,
                 loss_scale: Callable[[], float] | None = None) -> tuple[UpdatePlan, DeepSpeedUpdate | None]:
    """The plan of `spec` for `model`, and DeepSpeed's engine when the plan runs on DeepSpeed (None: torch);
    `loss_scale` as DeepSpeedUpdate's."""
    model.gradient_checkpointing = spec.algorithm.gradient_checkpointing  # copied along at ZeRO-3
    plan = plan_for(spec, model, device)
    if plan.engine != "deepspeed":
        return plan, None
    if not deepspeed_installed():
        raise RuntimeError("resources ask for DeepSpeed, which is not installed: pip install '.[deepspeed]'")
    return plan, DeepSpeedUpdate(model, spec.algorithm, plan, loss_scale)


class DeepSpeedUpdate:
    """rl/updater.py's `Updater` on DeepSpeed's engine (see the module docstring)."""

    def __init__(self, model: Transformer, algo: AlgorithmConfig, plan: UpdatePlan,
                 loss_scale: Callable[[], float] | None = None) -> None:
        """loss_scale: data parallelism's factor on each rank's loss (its share of the global normaliser x world,
        multigpu/data_parallel.py); None: 1 (one process)."""
        device = next(model.parameters()).device
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")  # before the import
        import deepspeed

        ensure_process_group("nccl" if device.type == "cuda" else "gloo")
        self.plan = plan
        self.rollout_model = model  # what the rollout engine runs
        self.train_model = copy.deepcopy(model) if plan.zero_stage == 3 else model  # partitioned at stage 3
        self.forward_module = ResponseLogits(self.train_model)
        params = trainable_params(self.train_model)
        low = any(p.dtype in LOW_PRECISION for p in params)
        if plan.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            base: torch.optim.Optimizer = DeepSpeedCPUAdam(params, lr=algo.learning_rate,
                                                           weight_decay=algo.weight_decay, adamw_mode=True)
        else:
            base = torch.optim.AdamW(params, **adamw_kwargs(params, algo))
        before = [p.data_ptr() for p in params]
        n = sum(p.numel() for p in params)
        self.engine, _, _, _ = deepspeed.initialize(model=self.forward_module, optimizer=base,
                                                    config=ds_config(plan, algo, low, n))
        if plan.zero_stage == 3:  # the head is used outside the layer modules' calls (tied: the embedding)
            deepspeed.zero.register_external_parameter(self.forward_module, self.train_model.head_weight)
        self.moved_storage = plan.zero_stage < 3 and before != [p.data_ptr() for p in params]
        self.base_optimizer = base  # the LR schedule sets its param groups' lr
        self.optimizer: torch.optim.Optimizer = base
        self.master = MasterWeights(trainable_params(model), enabled=False)  # DeepSpeed keeps its own fp32 copies
        self.loss_scale = loss_scale

    def policy_logits(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [b, S], [n] -> [n, V]
        return self.engine(input_ids, at)

    def begin(self) -> None:
        """ZeRO-3 trains a copy, built while the rollout engine held the model in eval mode: without train mode,
        gradient checkpointing never engages (a 7B forward OOMs). DeepSpeed clears its own gradients."""
        self.train_model.train()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch; `last` closes the step's accumulation (DeepSpeed reduces / steps then)."""
        self.engine.set_gradient_accumulation_boundary(last)
        scale = self.loss_scale() if self.loss_scale is not None else 1.0
        self.engine.backward(loss * scale if scale != 1.0 else loss)

    def step(self) -> float:
        """The optimizer step (clipped by the global norm); returns that norm before clipping."""
        sync_hyperparams(self.engine.optimizer, self.base_optimizer)  # partial offload: the GPU share's optimizer
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    @torch.no_grad()
    def sync_engine_weights(self) -> None:
        """Stage 3: the rollout engine's whole weights := the trained (partitioned) ones, one tensor at a time on
        the device. Stages 0-2: nothing (the engine runs the trained module). Every rank must call it."""
        if self.train_model is self.rollout_model:
            return
        import deepspeed

        for src, dst in zip(self.train_model.parameters(), self.rollout_model.parameters(), strict=True):
            with deepspeed.zero.GatheredParameters([src]):
                dst.copy_(src)

    # ------------------------------------------------------------------------------------------------ checkpoints
    @staticmethod
    def checkpoint_dir(root: Path) -> Path:
        """DeepSpeed's checkpoints of a run: root/deepspeed/step-N (one tag per checkpoints/step-N)."""
        return root / "deepspeed"

    def _gpu_share_file(self, root: Path, step: int) -> Path:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.checkpoint_dir(root) / f"step-{step}" / f"gpu_optimizer_share_rank{rank}.pt"

    def save(self, root: Path, step: int) -> None:
        """Every rank writes its shard of the optimizer (fp32 master weights, moments) under the tag step-N; with
        partial offload also the Adam state of the GPU share, which DeepSpeed's checkpoint leaves out."""
        self.engine.save_checkpoint(str(self.checkpoint_dir(root)), tag=f"step-{step}", save_latest=False)
        if self.plan.offload_optimizer and self.plan.offload_ratio < 1:
            torch.save(gpu_share_state(self.engine.optimizer), self._gpu_share_file(root, step))

    def load(self, root: Path, step: int) -> None:
        """Every rank reads its shard back; the engine's weights follow (stage 3: gathered into its copy)."""
        path, _ = self.engine.load_checkpoint(str(self.checkpoint_dir(root)), tag=f"step-{step}",
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint step-{step} under {self.checkpoint_dir(root)}")
        share = self._gpu_share_file(root, step)
        if share.exists() or (self.plan.offload_optimizer and self.plan.offload_ratio < 1):
            load_gpu_share_state(self.engine.optimizer, torch.load(share, weights_only=True))
        self.sync_engine_weights()


def prune_deepspeed_checkpoints(root: Path, keep_steps: set[int]) -> None:
    """Remove DeepSpeed tags without a complete checkpoints/step-N beside them (pruned or never completed)."""
    ds_dir = DeepSpeedUpdate.checkpoint_dir(root)
    if not ds_dir.is_dir():
        return
    for tag in ds_dir.iterdir():
        if tag.is_dir() and tag.name.startswith("step-") and int(tag.name[5:]) not in keep_steps:
            shutil.rmtree(tag, ignore_errors=True)  # ranks of one job may prune at once
