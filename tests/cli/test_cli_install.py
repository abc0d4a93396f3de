"""A non-editable `pip install .` ships conf/ and recipes/, and rlhf-run works from anywhere.

Fast and offline: a new venv without pip that sees this environment's packages through a .pth
file, and `pip install --no-deps --no-build-isolation --no-index` of a copy of the project into it
(nothing is downloaded, torch included). About 10 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NEEDED = ["pyproject.toml", "setup.py", "README.md", "rlhf", "conf", "recipes", "hydra_plugins"]


def test_non_editable_install_finds_conf_and_recipes(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in NEEDED:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_conf", "_recipes"))
        elif p.exists():
            shutil.copy2(p, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", str(src)],
        check=True, env=env, cwd=tmp_path,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(py), "-c", "import rlhf, rlhf.paths as p; print(rlhf.__file__); print(p.conf_dir()); print(p.recipes_dir())"],
        capture_output=True, text=True, check=True, cwd=elsewhere, env=env,
    ).stdout.split()
    assert where[0].startswith(purelib) and where[1].endswith("rlhf/_conf") and where[2].endswith("rlhf/_recipes")
    assert Path(where[1], "algo", "grpo.yaml").is_file() and Path(where[1], "model_defaults", "tiny.yaml").is_file()
    assert Path(purelib, "rlhf", "spec", "build.py").is_file()  # subpackages ship too

    run = subprocess.run(
        [str(venv / "bin" / "rlhf-run"), "algo=grpo", "placement=hybrid", "model=llama3-8b", "hardware=8xh100", "--plan"],
        capture_output=True, text=True, cwd=elsewhere, env=env,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("run: grpo · hybrid · llama3-8b · 8xh100")
    # every GPU and host figure is printed and fits: no ✗ line but the disk's, whose verdict is this
    # machine's free space (rlhf.plan.disk)
    lines = run.stdout.splitlines()
    assert any(ln.startswith("  training phase:") for ln in lines) and any(
        ln.startswith("  generation phase:") for ln in lines) and any(
        ln.startswith("host memory per node: ") for ln in lines), run.stdout
    disk = [ln for ln in lines if ln.startswith("✗ does not fit: the disk at")]
    others = [ln for ln in lines if ln.startswith("✗") and ln not in disk and ln != "✗ does not fit (see above)"]
    assert others == [], run.stdout
    assert lines[-1] == ("✗ does not fit (see above)" if disk else "✓ fits"), run.stdout
    recipe = subprocess.run([str(venv / "bin" / "rlhf-run"), "recipe=ppo_llama3_8b_8xh100", "--plan"],
                            capture_output=True, text=True, cwd=elsewhere, env=env)
    assert recipe.returncode == 0 and recipe.stdout.startswith("run: ppo · hybrid · llama3-8b"), recipe.stderr
    bad = subprocess.run([str(venv / "bin" / "rlhf-run"), "algo=grpoo"], capture_output=True, text=True,
                         cwd=elsewhere, env=env)
    assert bad.returncode == 2 and "Choose one of: cispo, dapo, dpo, dr_grpo, grpo" in bad.stderr
    assert "Traceback" not in bad.stderr
