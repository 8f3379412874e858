"""How the policy update runs and where its memory goes: the torch AdamW update, or DeepSpeed with a ZeRO stage and
optional optimizer offload, taken from the job spec and, where the spec leaves it open, from the parameter count
against the GPU's and the host's memory. Pure arithmetic: no torch, no DeepSpeed import.

    plan = plan_update(spec.resources, spec.algorithm, args, n_params, world=1, gpu_bytes=..., host_bytes=...,
                       low_precision=True, kv_cache_bytes=0, deepspeed_installed=True)
    plan.engine, plan.zero_stage, plan.offload_optimizer, plan.offload_ratio, plan.gpu_bytes, plan.host_bytes,
    plan.lines()

Bytes per trained parameter (N parameters, W ranks, bf16 weights trained through fp32 master weights):

                    torch  ZeRO-0  ZeRO-1  ZeRO-2  ZeRO-3            ZeRO-1/2 + offload   ZeRO-3 + offload, ratio r
    bf16 weights       2      2       2       2     2/W + 2 engine    as without offload   as without offload
    bf16 gradients     2      2       2      2/W    bucket            as without offload   as without offload
    fp32 master        4      4      4/W     4/W    4/W               on the host          share r on the host,
    fp32 gradients     4      4      4/W     4/W    4/W               on the host            1 - r on the GPU
    Adam moments       8      8      8/W     8/W    8/W               on the host
    grad accumulation                                                 2 on the host        4/W on the host

An fp32 model has no master copy and fp32 gradients only (16 bytes per parameter replicated). ZeRO-3 partitions the
weights the colocated rollout engine reads whole, so the engine keeps its own bf16 copy (the "engine" row); its
bf16 gradients pass through a reduce bucket of 5e8 elements and are not kept whole. With offload, DeepSpeed
accumulates the micro-batches' gradients on the host apart from the optimizer's fp32 gradients: at stages 1-2 in a
bf16 buffer of each whole parameter (stage_1_and_2.py, `accumulated_grads_in_cpu`), at stage 3 in one fp32 buffer
of the rank's partition (stage3.py, `grad_partitions_flat_buffer`). Partial offload (`offload_ratio` r < 1, ZeRO-3
only, DeepSpeed's `offload_optimizer.ratio`): the last share r of the optimizer's sub-groups is stepped on the host
by CPU Adam, the rest on the GPU by torch AdamW. Pinned host buffers (the gradients) may take up to twice their size
(torch's pinned allocator rounds each up to a power of two; a buffer is staged through a pageable copy), so the
state is pinned only when that worst case fits the host budget (`pin_host`); else it stays pageable, and the
host-device copies are slower.
Activations of one micro-batch of T = algorithm.micro_batch_tokens tokens: about (8H + 5I) x 2 bytes per token and
layer without gradient checkpointing (norm inputs, q/k/v, attention output, the SwiGLU's gate/up, product and down
input), H x 2 with it (plus one layer's while it is recomputed), and fp32 logits over the vocabulary x 3 (logits,
log-softmax, gradient). Budgets: 90% of the GPU (allocator slack, CUDA context) less the KV cache when it is not
released for the update; 80% of the host.

Choice when the spec leaves it open (`update_engine: auto`, `zero_stage: null`, `offload_optimizer: null`): the
torch update when it fits and no ZeRO / offload was asked for (several ranks at stage 0 are the torch data-parallel
update, multigpu/update.py); else DeepSpeed at the lowest stage from 1 that fits on the GPU, else with optimizer
offload (stage 2 on one rank, the lowest fitting stage on several), else at stage 3 with the ratio in the middle of
those where both the GPU and the host fit (rounded to 0.05). When nothing fits, `fits` is False and `lines()` says by
how much. A CPU process (`on_gpu=False`) under `auto` always
keeps the torch update: the budgets are the host's, and DeepSpeed's CPU path buys nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.tlt.config import AlgorithmConfig, Resources
from worker.tlt.model.args import ModelArgs

GPU_USABLE = 0.90  # of the device's memory: the CUDA context, allocator slack and fragmentation take the rest
HOST_USABLE = 0.80  # of the host's memory: the OS, data loading and pinned staging buffers take the rest
REDUCE_BUCKET = 5e8  # elements: DeepSpeed's default reduce_bucket_size, the bf16 gradients ZeRO-3 holds at once
RATIO_STEP = 0.05  # the plan's offload ratios are multiples of this


@dataclass(frozen=True)
class UpdatePlan:
    engine: str  # "torch" | "deepspeed"
    zero_stage: int  # 0-3 (0 for the torch update)
    offload_optimizer: bool
    gpu_bytes: float  # per rank, estimated peak of the update
    host_bytes: float  # per rank, the offloaded optimizer state (0 without offload)
    gpu_budget: float
    host_budget: float
    parts: dict[str, tuple[float, str]] = field(default_factory=dict)  # component -> (bytes, "gpu" | "host")
    offload_ratio: float = 1.0  # with offload: the optimizer state's share on the host (< 1 at ZeRO-3 only)
    pin_host: bool = True  # with offload: pin the host buffers (see the module docstring)

    @property
    def fits(self) -> bool:
        return self.gpu_bytes <= self.gpu_budget and self.host_bytes <= self.host_budget

    def lines(self) -> list[str]:
        """The arithmetic, one component a line (the log and the benchmark's table)."""
        gb = 1e9
        out = [f"{name}: {b / gb:.2f} GB ({where})" for name, (b, where) in self.parts.items()]
        out.append(f"GPU {self.gpu_bytes / gb:.1f} of {self.gpu_budget / gb:.1f} GB, host {self.host_bytes / gb:.1f} "
                   f"of {self.host_budget / gb:.1f} GB -> {'fits' if self.fits else 'does not fit'}")
        return out

    def summary(self) -> str:
        how = "torch AdamW" if self.engine == "torch" else f"DeepSpeed ZeRO-{self.zero_stage}"
        off = f" + optimizer offload (ratio {self.offload_ratio:g})" if self.offload_optimizer else ""
        return f"{how}{off}: {self.gpu_bytes / 1e9:.1f} GB GPU, {self.host_bytes / 1e9:.1f} GB host per rank"


def count_params(args: ModelArgs) -> int:
    """Parameters of a Transformer of shape `args` (what model/transformer.py builds)."""
    h, hd, kv = args.dim, args.hd, args.n_kv_heads
    attn = h * (args.n_heads + 2 * kv) * hd + args.n_heads * hd * h
    if args.qkv_bias:
        attn += (args.n_heads + 2 * kv) * hd
    if args.qk_norm:
        attn += 2 * hd
    layer = attn + 3 * h * args.intermediate_size + 2 * h
    head = 0 if args.tie_word_embeddings else args.vocab_size * h
    return args.n_layers * layer + args.vocab_size * h + head + h


def activation_bytes(args: ModelArgs, tokens: int, checkpointing: bool) -> float:
    """Peak activation memory of one micro-batch of `tokens` tokens (see the module docstring)."""
    per_layer = (8 * args.dim + 5 * args.intermediate_size) * 2 * tokens
    kept = args.n_layers * args.dim * 2 * tokens + per_layer if checkpointing else args.n_layers * per_layer
    return kept + 3 * 4 * tokens * args.vocab_size


def memory_parts(n: int, world: int, stage: int, offload: bool, low_precision: bool, engine: str,
                 ratio: float = 1.0) -> dict[str, tuple[float, str]]:
    """Bytes per rank of each training-state component (the module docstring's table); `ratio`: with offload, the
    optimizer state's share on the host."""
    w = world
    if not low_precision:  # fp32 weights are the master copy; gradients in fp32
        weights = 4 * n / w + 4 * n if stage == 3 else 4 * n
        moments = 8 * n / w if stage >= 1 else 8 * n
        parts = {"fp32 weights" + (" + engine copy" if stage == 3 else ""): (weights, "gpu"),
                 "fp32 gradients": (4 * n / w if stage >= 2 else 4 * n, "gpu")}
        return parts | _split("Adam moments", moments, ratio if offload else 0.0)
    shard = 1 / w if (engine == "deepspeed" and stage >= 1) else 1.0
    parts = {
        "bf16 weights" + (" (shard) + engine copy" if stage == 3 else ""): (2 * n / w + 2 * n if stage == 3 else 2 * n,
                                                                             "gpu"),
        "bf16 gradients" + (" (reduce bucket)" if stage == 3 else ""): (
            2 * min(n, REDUCE_BUCKET) if stage == 3 else 2 * n / w if stage == 2 else 2 * n, "gpu"),
    }
    if offload and stage == 3:
        parts["fp32 gradient accumulation"] = (4 * n / w, "host")
        return parts | _split("fp32 master + gradients + Adam moments", 16 * n / w, ratio)
    if offload:
        parts["bf16 gradient accumulation (whole parameters)"] = (2 * n, "host")
    where = "host" if offload else "gpu"
    return parts | {"fp32 master weights": (4 * n * shard, where), "fp32 gradients": (4 * n * shard, where),
                    "Adam moments": (8 * n * shard, where)}


def _split(name: str, nbytes: float, host_share: float) -> dict[str, tuple[float, str]]:
    """`nbytes` of `name`, the share `host_share` on the host and the rest on the GPU (one entry where it is 0)."""
    if host_share <= 0.0:
        return {name: (nbytes, "gpu")}
    if host_share >= 1.0:
        return {name: (nbytes, "host")}
    return {f"{name}, {1 - host_share:.0%} on the GPU": ((1 - host_share) * nbytes, "gpu"),
            f"{name}, {host_share:.0%} on the host": (host_share * nbytes, "host")}


def pinned_bytes(n: int, world: int, stage: int, ratio: float) -> float:
    """The host buffers DeepSpeed pins with offload: the gradients and their accumulation (the table's rows)."""
    return 4 * n / world + (4 * ratio * n / world if stage == 3 else 2 * n)


def _plan(engine: str, stage: int, offload: bool, n: int, world: int, low_precision: bool, act: float,
          gpu_budget: float, host_budget: float, ratio: float = 1.0) -> UpdatePlan:
    parts = memory_parts(n, world, stage, offload, low_precision, engine, ratio)
    parts["activations (one micro-batch)"] = (act, "gpu")
    gpu = sum(b for b, where in parts.values() if where == "gpu")
    host = sum(b for b, where in parts.values() if where == "host")
    pin = offload and host + pinned_bytes(n, world, stage, ratio) <= host_budget  # the pinned allocator's worst case
    return UpdatePlan(engine, stage, offload, gpu, host, gpu_budget, host_budget, parts,
                      ratio if offload else 1.0, pin)


def partial_offload_ratio(n: int, world: int, low_precision: bool, act: float, gpu_budget: float,
                          host_budget: float) -> float | None:
    """The ZeRO-3 offload ratio in the middle of those where both the GPU and the host fit (a multiple of
    RATIO_STEP), or None when no ratio fits both: GPU bytes fall and host bytes rise linearly with the ratio."""
    def at(r: float) -> UpdatePlan:
        return _plan("deepspeed", 3, True, n, world, low_precision, act, gpu_budget, host_budget, r)

    steps = round(1 / RATIO_STEP)
    ok = [k for k in range(1, steps + 1) if at(k / steps).fits]
    return ok[len(ok) // 2] / steps if ok else None


def plan_update(res: Resources, algo: AlgorithmConfig, args: ModelArgs, n_params: int, *, world: int,
                gpu_bytes: float, host_bytes: float, low_precision: bool, kv_cache_bytes: float = 0.0,
                deepspeed_installed: bool = True, on_gpu: bool = True) -> UpdatePlan:
    """The update's engine, ZeRO stage and offload (see the module docstring). `gpu_bytes`: one device's memory
    (for a CPU job, the host's); `kv_cache_bytes`: what the rollout engine keeps during the update."""
    act = activation_bytes(args, algo.micro_batch_tokens, algo.gradient_checkpointing)
    gpu_budget = GPU_USABLE * gpu_bytes - kv_cache_bytes
    host_budget = HOST_USABLE * host_bytes

    def make(engine: str, stage: int, offload: bool, ratio: float = 1.0) -> UpdatePlan:
        return _plan(engine, stage, offload, n_params, world, low_precision, act, gpu_budget, host_budget, ratio)

    torch_plan = make("torch", 0, False)
    if res.update_engine == "torch" or (res.update_engine == "auto" and not deepspeed_installed):
        return torch_plan
    asked_ds = ((res.zero_stage or 0) > 0 or bool(res.offload_optimizer) or res.offload_ratio is not None
                or res.update_engine == "deepspeed")
    if not asked_ds and (torch_plan.fits or not on_gpu):  # `auto` with nothing asked of DeepSpeed
        return torch_plan
    if res.offload_ratio is not None and res.offload_ratio < 1:  # stage 3 (validated in Resources)
        return make("deepspeed", 3, True, res.offload_ratio)
    # stage 0 replicates what the torch update does; stage 1 on one rank is DeepSpeed's bf16 optimizer (fp32 master
    # weights and gradient accumulation), the same memory
    stages = {False: [1] if world == 1 else [1, 2, 3], True: [2] if world == 1 else [1, 2, 3]}
    asked_offload = True if res.offload_ratio is not None else res.offload_optimizer  # ratio 1: the whole state
    offloads = [asked_offload] if asked_offload is not None else [False, True]
    candidates = [make("deepspeed", s, o) for o in offloads
                  for s in ([res.zero_stage] if res.zero_stage is not None else stages[o])]
    fitting = next((p for p in candidates if p.fits), None)
    if fitting is not None:
        return fitting
    if asked_offload is None and res.zero_stage in (None, 3):  # split the optimizer state between GPU and host
        ratio = partial_offload_ratio(n_params, world, low_precision, act, gpu_budget, host_budget)
        if ratio is not None:
            return make("deepspeed", 3, True, ratio)
    return candidates[-1]
