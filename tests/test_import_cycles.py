"""No import cycles among rlhf modules: every ``import`` of an rlhf module, at module level or
inside a function, is an edge; a cycle is a strongly connected component of more than one module
(or a module importing itself). Function-level imports count: deferring an import hides a cycle
from Python, not from the reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlhf"
# The one cycle left: the sweep composes jobs with cli.py's functions, cli.py hands ``-m`` to the
# sweep, and the Hydra app registers cli.py's configs. It ends when composition moves out of cli.py into a config layer of its own (issue 17,
# part 4); the test fails if it grows or another cycle appears.
KNOWN_CYCLES = [["rlhf.cli", "rlhf.hydra_app", "rlhf.sweep"]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path, known: set[str]) -> set[str]:
    """The rlhf modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod`` when that
    is a module; ``import a.b.c`` as ``a.b.c``). A package's own ``__init__`` is not an edge of
    its submodules' imports: ``import rlhf.x.y`` runs ``rlhf.x`` first, but that is Python's order,
    not a dependency the code chose."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # a submodule where the name is one, else a name of the package's __init__
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # the longest prefix that is an rlhf module
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + "."):
                out.add(name)
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    root = package.parent
    files = {module_name(p, root): p for p in package.rglob("*.py")}
    known = set(files)
    return {m: imported_modules(p, root, known) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles_among_rlhf_modules():
    found = [c for c in cycles(import_graph(PACKAGE)) if c not in KNOWN_CYCLES]
    assert not found, "import cycles (each line one cycle):\n" + "\n".join(" ↔ ".join(c) for c in found)


def test_finder_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "rlhf"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from rlhf.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("import rlhf.a\n")
    (pkg / "d.py").write_text("from rlhf import a\n")
    graph = import_graph(pkg)
    assert graph["rlhf.a"] == {"rlhf.sub.b"} and graph["rlhf.sub.b"] == {"rlhf.sub.c"}
    assert graph["rlhf.d"] == {"rlhf.a"}
    assert cycles(graph) == [["rlhf.a", "rlhf.sub.b", "rlhf.sub.c"]]
