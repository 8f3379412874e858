"""The import graph: no module of worker/tlt imports itself back through others (imports inside
`if TYPE_CHECKING:` and inside functions count too: a circle there still ties the modules together); across the
whole house (worker/ and backend/) no circle of the imports that run at import time (module level, outside
`if TYPE_CHECKING:`); and the layers hold: decoding/ is the bottom (model/ only), kernels/ build on it and never on
rollout/, speculative/ or anything above; the engine (rollout/) never imports a drafter (speculative/drafter/,
speculative/proposers/ngram.py, speculative/proposers/small_model.py), the SD controller (speculative/control/) or
the trainer (rl/); the engine-facing SD parts (speculative/arm.py, proposers/, verify/) never import rollout/, the
controller or the EAGLE drafter; the controller imports none of the engine, the proposers, the verifier, the drafter
or the kernels; speculative/__init__.py imports nothing (the engine's imports of the package stay this narrow); no
rollout helper imports the engine; the library never imports the service (backend/, the Celery plumbing); the API
(backend/) never imports the worker's runtime (the Celery app, tasks, the job runner), only the library's pure spec,
catalogue and registry modules, and the algorithm registry it reads imports no torch at import time. Read from the
sources with ast, nothing imported.
Run: python -m pytest tests/engine/test_engine_layers.py -q"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "worker" / "tlt"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements that run when the module is imported: module level (also inside a module-level `if` or
    `try`), not under `if TYPE_CHECKING:`, not inside functions or classes."""
    out: list[ast.stmt] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo.extend(node.body)
            todo.extend(node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend([*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)])
    return out


def _imports(path: Path, modules: set[str], runtime_only: bool = False) -> set[str]:
    """Modules of `modules` that `path` imports (any import statement in the file, or with `runtime_only` those of
    _runtime_imports; `from pkg import name` counts as the submodule pkg.name when that is a module)."""
    tree = ast.parse(path.read_text())
    me = _module(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in _runtime_imports(tree) if runtime_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(me)
    return out


def _graph(roots: tuple[Path, ...] = (LIB,), runtime_only: bool = False) -> dict[str, set[str]]:
    files = sorted(f for root in roots for f in root.rglob("*.py"))
    modules = {_module(f) for f in files}
    return {_module(f): _imports(f, modules, runtime_only) for f in files}


def _house() -> dict[str, set[str]]:
    """worker/ and backend/, the imports that run at import time."""
    return _graph((ROOT / "worker", ROOT / "backend"), runtime_only=True)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _offenders(graph: dict[str, set[str]], src: str, banned: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() if m == src or m.startswith(src + ".")
                  for d in deps if any(d == b or d.startswith(b + ".") for b in banned))


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "worker.tlt.rollout.engine" in graph and "worker.tlt.decoding.kv_cache" in graph
    assert "worker.tlt.rollout.engine_state" in graph["worker.tlt.rollout.engine"]
    # the detector finds a circle when there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_no_import_circles_in_the_house() -> None:
    house = _house()
    assert "backend.main" in house and "worker.tasks" in house and "worker.cli.parser" in house
    assert "worker.cli.jobs" in house["worker.cli.parser"]
    assert _cycles(house) == []


def test_runtime_imports_skip_type_checking_and_functions() -> None:
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
                     "try:\n    import d\nexcept ImportError:\n    import e\ndef f():\n    import g\n")
    names = {a.name for n in _runtime_imports(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"a", "c", "d", "e"}


def test_layers() -> None:
    g = _graph()
    t = "worker.tlt"
    sd = f"{t}.speculative"
    control, drafter = f"{sd}.control", f"{sd}.drafter"
    drafters = (drafter, f"{sd}.proposers.ngram", f"{sd}.proposers.small_model")
    engine_facing = (f"{sd}.arm", f"{sd}.proposers", f"{sd}.verify")  # what the engine may import of speculative/
    above_model = (f"{t}.kernels", f"{t}.rollout", sd, f"{t}.rl", f"{t}.multigpu", f"{t}.config", f"{t}.build")
    assert f"{sd}.proposers.protocol" in g and f"{control}.controller" in g and f"{drafter}.eagle_proposer" in g
    assert _offenders(g, f"{t}.decoding", above_model) == []
    assert _offenders(g, f"{t}.kernels", (f"{t}.rollout", sd, f"{t}.rl")) == []
    # the engine is driven by the SD controller it is given, through its own protocol (rollout/controller_protocol.py):
    # nothing of speculative/control/, not even under TYPE_CHECKING
    assert _offenders(g, f"{t}.rollout", (*drafters, f"{t}.rl", control)) == []
    for part in engine_facing:
        assert _offenders(g, part, (f"{t}.rollout", control, drafter)) == []
    assert _offenders(g, control, (f"{t}.rollout", f"{sd}.proposers", f"{sd}.verify", drafter, f"{t}.kernels")) == []
    assert g[sd] == set()  # speculative/__init__.py: a map of the package, no imports
    helpers = [m for m in g if m.startswith(f"{t}.rollout.") and m != f"{t}.rollout.engine"]
    assert [m for m in helpers if f"{t}.rollout.engine" in g[m]] == []  # helpers take the EngineState


def test_the_library_never_imports_the_service() -> None:
    g = _graph((ROOT / "worker", ROOT / "backend"))
    service = ("backend", "worker.tasks", "worker.celery_app", "worker.job_child", "worker.db_reporter",
               "worker.registry", "worker.cli")
    assert _offenders(g, "worker.tlt", service) == []


WORKER_RUNTIME = ("worker.tasks", "worker.celery_app", "worker.job_child", "worker.runner", "worker.db_reporter",
                  "worker.registry", "worker.cli", "worker.client")


def test_the_api_never_imports_the_worker_runtime() -> None:
    g = _graph((ROOT / "worker", ROOT / "backend"))
    assert "worker.celery_app" in g and "backend.core.dispatch" in g
    assert _offenders(g, "backend", WORKER_RUNTIME) == []
    # the detector sees an import inside a function (the way dispatch.py once reached the Celery app)
    assert _offenders({"backend.x": {"worker.celery_app"}}, "backend", WORKER_RUNTIME) == [
        ("backend.x", "worker.celery_app")]


def test_the_algorithm_registry_imports_no_torch_at_import_time() -> None:
    path = LIB / "rl" / "algorithms" / "registry.py"
    tops = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in _runtime_imports(ast.parse(path.read_text()))
            for a in n.names if isinstance(n, ast.ImportFrom | ast.Import)}
    assert "torch" not in tops and tops <= {"__future__", "importlib", "typing"}


def test_the_rollout_backend_rules_import_no_torch_at_import_time() -> None:
    """The API refuses specs from worker/tlt/rollout_backends.py: it must read the spec's rules without torch or
    vLLM (the backend package itself imports vLLM only inside its functions)."""
    path = LIB / "rollout_backends.py"
    tops = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in _runtime_imports(ast.parse(path.read_text()))
            for a in n.names if isinstance(n, ast.ImportFrom | ast.Import)}
    assert tops <= {"__future__", "importlib", "worker"}
    deps = {n.module for n in _runtime_imports(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
    assert deps <= {"__future__", "importlib.util", "worker.tlt.config"}
