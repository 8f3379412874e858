"""The memory-bandwidth limit of a decode step: weight + KV bytes read per step over the GPU's bandwidth.

    bw, source = gpu_bandwidth(device)                      # bytes/s: the datasheet by GPU name, else measured
    roofline_tokens_per_s(args, batch=1, context=192, bandwidth=bw)

At decode sizes a step reads every weight once (the embedding table excepted: B rows) and each row's K/V columns;
compute and activations are small beside them, so batch / (bytes / bandwidth) bounds tokens per second. Used by
`tlt bench decode` to say how close a step runs to the hardware.
"""

from __future__ import annotations

import torch

from worker.tlt.model.args import ModelArgs

# Datasheet HBM bandwidth in TB/s by a substring of torch.cuda.get_device_name (the longest match wins)
PEAK_TBPS: dict[str, float] = {
    "H200": 4.8,
    "H100 SXM": 3.35,
    "H100 80GB HBM3": 3.35,
    "H100 NVL": 3.9,
    "H100 PCIe": 2.0,
    "H20": 4.0,
    "B200": 8.0,
    "A100-SXM4-80GB": 2.039,
    "A100-SXM4-40GB": 1.555,
    "A100 80GB PCIe": 1.935,
    "A100-PCIE-40GB": 1.555,
    "L40S": 0.864,
    "A10G": 0.6,
    "L4": 0.3,
    "RTX 4090": 1.008,
}


def datasheet_bandwidth(device_name: str) -> float | None:
    """Bytes/s for a known GPU name, else None."""
    hits = [k for k in PEAK_TBPS if k in device_name]
    return PEAK_TBPS[max(hits, key=len)] * 1e12 if hits else None


def measured_bandwidth(device: torch.device, gib: float = 1.0, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy (bytes read + written), for GPUs the table does not know."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * src.nbytes * reps / (start.elapsed_time(end) / 1e3)


def gpu_bandwidth(device: torch.device, override_tbps: float | None = None) -> tuple[float, str]:
    """(bytes/s, where the figure came from): `override_tbps`, the datasheet by name, or a measured copy."""
    if override_tbps is not None:
        return override_tbps * 1e12, "given"
    name = torch.cuda.get_device_name(device)
    sheet = datasheet_bandwidth(name)
    if sheet is not None:
        return sheet, f"datasheet ({name})"
    return measured_bandwidth(device), f"measured copy ({name})"


def layer_bytes(args: ModelArgs, dtype_bytes: int = 2) -> int:
    """Bytes of one decoder layer's weights (q|k|v with its bias, o, gate|up, down, the norms)."""
    h, d, hq, hkv, i = args.dim, args.hd, args.n_heads, args.n_kv_heads, args.intermediate_size
    qkv = h * (hq + 2 * hkv) * d + ((hq + 2 * hkv) * d if args.qkv_bias else 0)
    return dtype_bytes * (qkv + hq * d * h + 3 * h * i + 2 * h + (2 * d if args.qk_norm else 0))


def weight_bytes(args: ModelArgs, dtype_bytes: int = 2) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the head (the embedding table is
    gathered by row: not counted; a tied head reads it whole as the head)."""
    return args.n_layers * layer_bytes(args, dtype_bytes) + dtype_bytes * (args.dim + args.vocab_size * args.dim)


def kv_bytes(args: ModelArgs, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one decode step reads: `context` cache columns per row, every layer."""
    return dtype_bytes * batch * context * args.n_layers * 2 * args.n_kv_heads * args.hd


def roofline_tokens_per_s(args: ModelArgs, batch: int, context: int, bandwidth: float, dtype_bytes: int = 2) -> float:
    """The most tokens/s a decode step of `batch` rows at `context` columns can emit at `bandwidth` bytes/s."""
    step_s = (weight_bytes(args, dtype_bytes) + kv_bytes(args, batch, context, dtype_bytes)) / bandwidth
    return batch / step_s
