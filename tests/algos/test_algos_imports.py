"""rlhf.algos must stay pure torch: check the imports of every source file."""

import ast
import pathlib

import rlhf.algos

ALGOS_DIR = pathlib.Path(rlhf.algos.__file__).resolve().parent
FORBIDDEN = {"ray", "deepspeed", "vllm", "hydra", "omegaconf", "transformers", "accelerate"}
ALLOWED = {"torch", "math", "typing", "__future__", "dataclasses", "collections", "rlhf"}
# the registry imports the modules named in algo.plugins, and the built-ins' modules on first use
ALLOWED_IN = {"registry.py": {"importlib", "<importlib.import_module>"},
              "__init__.py": {"importlib", "<importlib.import_module>"},  # a name's home module on first use
              "logprobs.py": {"warnings"}}  # the compile-fallback warning


def _imported_top_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                mods.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            mods.add("<dynamic __import__>")
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            mods.add("<importlib.import_module>")
    return mods


def test_source_files_found():
    files = sorted(p.name for p in ALGOS_DIR.glob("*.py"))
    for expected in ["advantages.py", "kl.py", "shaping.py", "losses.py", "preference.py", "filters.py"]:
        assert expected in files


def test_algos_imports_are_pure_torch():
    seen = {}
    for path in sorted(ALGOS_DIR.rglob("*.py")):
        mods = _imported_top_modules(path)
        bad = mods & FORBIDDEN
        assert not bad, f"{path.name} imports forbidden modules {bad}"
        unexpected = mods - ALLOWED - ALLOWED_IN.get(path.name, set())
        assert not unexpected, f"{path.name} imports non-allowlisted modules {unexpected}"
        seen[path.name] = mods
    assert "torch" in seen["losses.py"]


def _fresh_python(code: str) -> str:
    """What ``code`` prints in a new interpreter (nothing imported before it), from the repo root."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ALGOS_DIR.parents[1]).stdout.strip()


def test_registry_and_package_import_no_torch():
    """The spec (no torch) reads the registry: importing it, through the package, loads no torch."""
    out = _fresh_python("import sys, rlhf.algos.registry as r; r.ADVANTAGE_ESTIMATORS.info('gae'); "
                        "print('torch' in sys.modules)")
    assert out == "False"


def test_package_name_loads_only_its_home_module():
    out = _fresh_python("import sys; from rlhf.algos import logprobs_from_hidden; "
                        "print(sorted(m for m in sys.modules if m.startswith('rlhf.algos.')))")
    assert out == "['rlhf.algos.logprobs']"


def test_scanner_detects_forbidden(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import os\nimport ray.util\nfrom deepspeed import zero\nfrom . import sibling\n")
    mods = _imported_top_modules(p)
    assert {"ray", "deepspeed", "os"} <= mods
    assert mods & FORBIDDEN == {"ray", "deepspeed"}
