"""No measuring switch is read from the environment: every variable worker/ reads (os.environ.get / [] / `in`,
os.getenv) is real configuration listed here, with what it configures. A benchmark or debug toggle belongs in
KernelConfig (worker/tlt/kernels/settings.py) or a command-line flag, never in a variable read somewhere inside the
library. The control plane reads its settings through pydantic-settings (backend/core/config.py), not os.environ.
Read from the sources with ast, nothing imported.
Run: python -m pytest tests/test_env_reads.py -q"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGURATION = {
    "TRITON_INTERPRET": "Triton's own switch: kernels run in its interpreter off CUDA (set before Triton is imported)",
    "RANK": "torch.distributed rendezvous (torchrun / DeepSpeed launcher convention)",
    "WORLD_SIZE": "torch.distributed rendezvous",
    "LOCAL_RANK": "torch.distributed rendezvous: the rank's device",
    "MASTER_ADDR": "torch.distributed rendezvous",
    "MASTER_PORT": "torch.distributed rendezvous",
    "CUDA_VISIBLE_DEVICES": "the GPUs a worker owns and hands to its jobs",
    "TLT_KEEP_LAST_CHECKPOINTS": "the operator's storage cap, set by the worker from Settings for its job children",
    "TLT_DATASETS_DIR": "where `tlt train` finds an uploaded dataset_id (the worker resolves ids to paths itself)",
    "TLT_URL": "the API the `tlt` client talks to (default of --url)",
    "TLT_TOKEN": "the client's credential (default of --token)",
}


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def _keys(key: ast.expr, constants: dict[str, str], loops: dict[str, list[str]]) -> list[str]:
    """The variable names a key expression can take: a literal, a module constant, or the variable of a
    comprehension over literals; anything else is reported as unresolved."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return [key.value]
    if isinstance(key, ast.Name) and key.id in constants:
        return [constants[key.id]]
    if isinstance(key, ast.Name) and key.id in loops:
        return loops[key.id]
    return [f"<unresolved {ast.unparse(key)}>"]


def env_reads(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of every environment read in `path`."""
    tree = ast.parse(path.read_text())
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    loops: dict[str, list[str]] = {}
    for gen in (n for n in ast.walk(tree) if isinstance(n, ast.comprehension)):
        if isinstance(gen.target, ast.Name) and isinstance(gen.iter, ast.Tuple | ast.List):
            loops[gen.target.id] = [e.value for e in gen.iter.elts if isinstance(e, ast.Constant)]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value):
                key = node.args[0]
            elif isinstance(f, ast.Attribute) and f.attr == "getenv" and isinstance(f.value, ast.Name) \
                    and f.value.id == "os":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, ast.In | ast.NotIn) for o in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None:
            out.extend((node.lineno, k) for k in _keys(key, constants, loops))
    return out


def test_reads_are_found() -> None:
    src = ROOT / "worker" / "tlt" / "multigpu" / "launch.py"
    found = {k for _, k in env_reads(src)}
    assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"} <= found


def test_detector_sees_every_form(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('import os\nNAME = "TLT_A"\nos.environ.get("TLT_B")\nos.environ[NAME]\nos.getenv("TLT_C")\n'
                 '"TLT_D" in os.environ\n[k for k in ("TLT_E",) if k in os.environ]\nos.environ.get(x)\n')
    assert sorted(env_reads(f)) == [(3, "TLT_B"), (4, "TLT_A"), (5, "TLT_C"), (6, "TLT_D"), (7, "TLT_E"),
                                    (8, "<unresolved x>")]


def test_the_worker_reads_only_configuration_from_the_environment() -> None:
    found = {(str(p.relative_to(ROOT)), line, k) for root in ("worker", "backend")
             for p in sorted((ROOT / root).rglob("*.py")) for line, k in env_reads(p)}
    assert [f for f in found if f[2] not in CONFIGURATION] == []
