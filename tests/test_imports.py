"""The import graph of verispec/ and benchmarks/: no cycles (imports inside functions included), and
verispec's layers stacked: a module imports only from its own layer or those below it, type-only
imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("verispec", "benchmarks")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, known: set[str], name: str, type_only: bool = False) -> set[str]:
    """The project modules `path` imports at run time: at the top or inside a function, but not
    under `if TYPE_CHECKING:` (annotations only) unless `type_only`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from pkg import module` depends on the module, not on pkg/__init__
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known} - {name}


def graph() -> dict[str, set[str]]:
    paths = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    known = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, known, module_name(p)) for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import b\n")
    b.write_text("def f():\n    import a\n")
    c = tmp_path / "c.py"
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    known = {"a", "b", "c"}
    edges = {p.stem: imports_of(p, known, p.stem) for p in (a, b, c)}
    assert cycles(edges) == [["a", "b"]]  # c's annotation-only import is not an edge


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_models_and_spec_decode_import_nothing_from_the_engine():
    below = {m: deps for m, deps in graph().items() if m.startswith(("verispec.models", "verispec.spec_decode",
                                                                      "verispec.sample"))}
    assert {m: sorted(d for d in deps if d.startswith("verispec.engine")) for m, deps in below.items()
            if any(d.startswith("verispec.engine") for d in deps)} == {}


# verispec's layers, bottom up: each imports only from its own layer and those below.
LAYERS = [
    {"verispec.envs", "verispec.host_memory", "verispec.cores", "verispec.outputs", "verispec.tokenization",
     "verispec.device_copy", "verispec.config", "verispec.sampling_params"},
    {"verispec.models"},
    {"verispec.distributed", "verispec.sample"},
    {"verispec.core"},  # the scheduler's world; its draft policy comes in through a protocol
    {"verispec.spec_decode"},
    {"verispec.worker"},
    {"verispec.engine"},
    {"verispec.train"},  # a drafter's training: data from a model handed in, nothing of the engine's
    {"verispec.entrypoints"},
    {"verispec", "verispec.__main__"},  # the public names and `python -m verispec`
]


def layer_of(module: str) -> int:
    """The layer of a module: its own entry, else its package's (verispec.core.scheduler -> core)."""
    for i, layer in enumerate(LAYERS):
        if module in layer or ".".join(module.split(".")[:2]) in layer:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def test_layers_import_only_downward_type_only_imports_included():
    paths = list((ROOT / "verispec").rglob("*.py"))
    known = {module_name(p) for p in paths}
    upward = sorted(f"{module_name(p)} -> {dep}" for p in paths
                    for dep in imports_of(p, known, module_name(p), type_only=True)
                    if layer_of(dep) > layer_of(module_name(p)))
    assert upward == []
