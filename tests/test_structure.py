"""The package's shape (CPU; imports nothing of ours): module sizes, no import cycles, and
imports that point one way: the torch API → kernels → layouts / pipelines.

The import graph is read from each file's ``ast``, at module level and inside functions (a
lazy import closes a cycle as well as a top-level one). An edge goes to the module named:
importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` first, but those implied
edges are left out, or every package whose ``__init__`` imports a submodule would be a cycle
with it; ``from a import name`` is an edge to ``a`` itself when ``name`` is not a module.
"""

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
# where each package's sources live (layouts/ and pipelines/ install under snapmla_cute)
PACKAGE_DIRS = {
    "snapmla_cute": ROOT / "snapmla_cute",
    "snapmla_cute.layouts": ROOT / "layouts",
    "snapmla_cute.pipelines": ROOT / "pipelines",
}
# the torch-facing API layer: what users call; nothing below it may import it
API_MODULES = {
    "snapmla_cute",  # the package's __init__ re-exports the API
    "snapmla_cute.decode",
    "snapmla_cute.steps",
    "snapmla_cute.fused",
    "snapmla_cute.planning",
    "snapmla_cute.tuning",
    "snapmla_cute.validation",
    "snapmla_cute.sparse",
    "snapmla_cute.distributed",
    "snapmla_cute.distributed_sparse",
    "snapmla_cute.torch_ops",
}
# the tools on top of the API (CLI, benchmarks, accuracy study, profiling)
TOOL_MODULES = {
    "snapmla_cute.cli",
    "snapmla_cute.bench",
    "snapmla_cute.bench_cp",
    "snapmla_cute.bench_sparse",
    "snapmla_cute.bench_latency",
    "snapmla_cute.peers",
    "snapmla_cute.timing",
    "snapmla_cute.accuracy",
    "snapmla_cute.profiling",
    "snapmla_cute.compile_report",
}


def _modules() -> dict[str, Path]:
    """Every module of the project by its import name."""
    mods = {}
    for pkg, root in PACKAGE_DIRS.items():
        for f in sorted(root.rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = f
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports anywhere in its file. ``from pkg import x`` names the
    module ``pkg.x`` when there is one, else ``pkg`` (x is a name defined there)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: relative import (the graph reads absolute ones)")
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # the shortest way back to the component's first module
        members, start = set(comp), min(comp)
        parent, frontier = {start: None}, [start]
        while frontier:
            v = frontier.pop(0)
            if start in graph[v]:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                cycles.append(path[::-1] + [start])
                break
            for w in sorted(graph[v] & members):
                if w not in parent:
                    parent[w] = v
                    frontier.append(w)
    return cycles


def _importers_of(modules, packages, sources) -> list[str]:
    """``a imports b`` for each module a of ``sources`` importing one of ``modules`` or a module
    of one of ``packages``."""
    hit = lambda b: b in modules or any(b == p or b.startswith(p + ".") for p in packages)  # noqa: E731
    return sorted(f"{a} imports {b}" for a in sources for b in GRAPH[a] if hit(b))


def _under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


def test_modules_stay_short():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in MODULES.values()}
    long = {f: n for f, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_graph_sees_the_project():
    # guards the checks below against a graph that found nothing
    assert {"snapmla_cute.kernels.decode_scheduler", "snapmla_cute.layouts.smem", "snapmla_cute.pipelines.roles",
            "snapmla_cute.reference"} <= set(MODULES)
    assert "snapmla_cute.kernels.decode_scheduler" in GRAPH["snapmla_cute.planning"]  # from pkg import module
    assert "snapmla_cute.kernels.decode.config" in GRAPH["snapmla_cute.planning"]  # inside a function
    assert "snapmla_cute" in GRAPH["snapmla_cute.bench"]  # from the package, a name


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_do_not_import_the_api():
    assert not _importers_of(API_MODULES | TOOL_MODULES, (), _under("snapmla_cute.kernels"))


def test_layouts_import_neither_the_api_nor_kernels():
    assert not _importers_of(API_MODULES | TOOL_MODULES, ("snapmla_cute.kernels",), _under("snapmla_cute.layouts"))


def test_pipelines_import_neither_the_api_nor_kernels():
    assert not _importers_of(API_MODULES | TOOL_MODULES, ("snapmla_cute.kernels",), _under("snapmla_cute.pipelines"))


def test_kernel_sources_import_only_what_the_compile_key_covers():
    """Code traced into kernels (kernels, layouts, pipelines) imports from the rest of the
    package only the modules whose sources ``jit_cache`` fingerprints: another import would
    change the generated code without changing the disk cache's key."""
    tree = ast.parse((ROOT / "snapmla_cute" / "jit_cache.py").read_text())
    traced = {name: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for name in [t.id for t in node.targets if isinstance(t, ast.Name)]
              if name in ("_TRACED_PACKAGES", "_TRACED_MODULES")}
    sources = [m for p in traced["_TRACED_PACKAGES"] for m in _under(p)]
    covered = set(traced["_TRACED_MODULES"])
    outside = sorted(f"{a} imports {b}" for a in sources for b in GRAPH[a]
                     if b not in covered and not any(b in _under(p) for p in traced["_TRACED_PACKAGES"]))
    assert not outside, outside


def test_kernel_functions_take_at_most_ten_parameters():
    """A function under ``snapmla_cute/kernels/`` takes at most 10 parameters (``self`` and
    ``cls`` aside): what travels together is a typed bundle (``kernels/decode/launch.py``,
    ``args.py``), never a long positional list."""
    long = []
    for name, path in MODULES.items():
        if not name.startswith("snapmla_cute.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                n = len(params) + (a.vararg is not None) + (a.kwarg is not None)
                if n > 10:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not long, long


def test_few_private_names_cross_modules():
    """What two modules share is a public name in a module named for its job: at most 10
    underscore names imported from another module of ours (``from snapmla_cute.x import _y``)."""
    private = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("snapmla_cute"):
                private += [f"{name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert len(private) <= 10, private


def test_decode_config_holds_at_most_sixteen_fields():
    """``DecodeConfig`` is the compile key of production launches: shape and mode, what the
    library sets, and the timing-only ``skip``/``trace``; measured A/B switches leave the
    tree (``profiles/NOTES.md``, "Schedule switches and fixed behaviour")."""
    tree = ast.parse((ROOT / "snapmla_cute" / "kernels" / "decode" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DecodeConfig")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert 8 <= len(fields) <= 16, fields


def test_experiments_stay_few():
    """``profiles/experiments/`` keeps the scripts behind current figures (at most 15); the
    others live in history, cited by hash (``profiles/README.md``)."""
    scripts = [p.name for p in (ROOT / "profiles" / "experiments").iterdir() if p.is_file()]
    assert len(scripts) <= 15, sorted(scripts)


def test_reference_imports_only_pure_helpers():
    """The specification stands on its own: plain torch plus our pure helpers."""
    spec = {"snapmla_cute.reference", "snapmla_cute.emulation", "snapmla_cute.sparse_reference"}
    allowed = spec | {"snapmla_cute.format", "snapmla_cute.tensor_core"}
    assert not [f"{m} imports {d}" for m in sorted(spec) for d in sorted(GRAPH[m]) if d not in allowed]


# --------------------------------------------------------------------------------------------
# The decode kernel's roles (kernels/decode/*): each role module may import the bundles and
# mechanics below it, never the kernel's wiring; only the consumer holds other roles.
# --------------------------------------------------------------------------------------------

DECODE = "snapmla_cute.kernels.decode"
ROLE_MODULES = {f"{DECODE}.{m}" for m in ("plan", "producer", "transposer", "consumer", "epilogue", "merge")}


def test_decode_roles_do_not_import_the_wiring_or_each_other():
    """A role module never imports ``kernel`` (the wiring) or ``step``/``compile`` (what
    launches it); of the other roles, the consumer imports the ones it is handed (epilogue,
    merger) and the epilogue the merger (the final LSE and the cluster merges), and every
    role may read the plan (``PartWork``)."""
    allowed_roles = {f"{DECODE}.consumer": {f"{DECODE}.{m}" for m in ("epilogue", "merge", "plan")},
                     f"{DECODE}.epilogue": {f"{DECODE}.merge"}}
    above = {f"{DECODE}.{m}" for m in ("kernel", "step", "compile")}
    bad = []
    for m in sorted(ROLE_MODULES):
        for d in sorted(GRAPH[m]):
            if d in above or (d in ROLE_MODULES and d != f"{DECODE}.plan"
                              and d not in allowed_roles.get(m, set())):
                bad.append(f"{m} imports {d}")
    assert not bad, bad
