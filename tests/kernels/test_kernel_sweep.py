"""bench/kernel_sweep.py --dry-run runs on CPU (Triton's interpreter, tiny model): every kernel, its torch
equivalent, the whole fused layer and forward go through the sweep's code path, and it writes the table and the JSON
with one `TUNED[...]` line per kernel. Run: python -m pytest tests/kernels/test_kernel_sweep.py -q"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernel_sweep.py"


def test_dry_run_writes_table_and_json(tmp_path: Path) -> None:
    main = runpy.run_path(str(BENCH), run_name="kernel_sweep")["main"]
    md, js = tmp_path / "s.md", tmp_path / "s.json"
    assert main(["--dry-run", "--out", str(md), "--json-out", str(js)]) == 0
    res = json.loads(js.read_text())
    kernels = [r["kernel"] for r in res["kernels"]]
    assert kernels == ["qkv_rope", "attention", "o_proj", "norm_gate_up", "down", "head"]
    for r in res["kernels"]:
        assert len(r["candidates"]) == 1 and r["best"] == r["default"]
        assert set(r["torch_us"]) == set(r["best_us"]) == {str(m) for m in res["ms"]}
    assert {"layer_best_us", "forward_default_us", "forward_torch_us"} <= set(res["whole"])
    text = md.read_text()
    assert text.count("\nTUNED[") == 6 and "TUNED[('linear_residual', 64, 128)]" in text  # down_proj: (H, I)
    assert text.count("| forward (2 layers + head) |") == 3
