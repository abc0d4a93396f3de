"""Every ``spec`` in rlhf/ says what it is: a parameter or attribute named ``spec`` or ``*_spec`` is
annotated, and not with ``Any`` (``RunSpec``, or the part it takes: ``ModelSpec``, ``DataSpec``, ...),
so a reader can go from any function to the fields it may read."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlhf"
VAGUE = {"Any", "Optional[Any]", "typing.Any", "object"}


def _is_spec(name: str) -> bool:
    return name == "spec" or name.endswith("_spec")


def _vague(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return True
    text = ast.unparse(annotation)
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        text = annotation.value
    return text in VAGUE


def untyped_specs(source: str, filename: str) -> list[str]:
    """``file:line name`` of every spec parameter (functions, methods, lambdas excluded) or class
    attribute that is unannotated or annotated as Any."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                if _is_spec(arg.arg) and _vague(arg.annotation):
                    out.append(f"{filename}:{arg.lineno} {node.name}({arg.arg})")
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and _is_spec(st.target.id)
                        and _vague(st.annotation)):
                    out.append(f"{filename}:{st.lineno} {node.name}.{st.target.id}")
    return out


def test_every_spec_in_rlhf_is_typed():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += untyped_specs(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, ("annotate these with RunSpec (rlhf.spec.runspec) or the part they take "
                       "(rlhf.spec.schema):\n" + "\n".join(found))


def test_finder_sees_params_attributes_and_any():
    src = (
        "from typing import Any, Optional\n"
        "def a(spec): ...\n"
        "def b(x, *, model_spec: Any = None): ...\n"
        "def c(spec: 'RunSpec', data_spec: DataSpec): ...\n"
        "class K:\n"
        "    spec: Optional[Any]\n"
        "    other: Any\n"
        "    def m(self, spec: RunSpec, reward_spec: 'Any'): ...\n"
    )
    assert untyped_specs(src, "f.py") == ["f.py:2 a(spec)", "f.py:3 b(model_spec)", "f.py:6 K.spec",
                                          "f.py:8 m(reward_spec)"]
