"""docs/architecture.md lists the files a GRPO step crosses from ``rlhf-run`` to the policy loss
(the call stack at the loss, driver then worker). This checks the list against the code: the
files in the doc's order, and each hop's caller naming its callee, so that moving a function or
adding a file on the way fails here until the doc says so."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (file, function, a name its body uses to make the next call), in stack order
HOPS = [
    ("rlhf/cli.py", "main", "run_in_hydra"),
    ("rlhf/cli.py", "run_in_hydra", "run_app"),
    ("rlhf/hydra_app.py", "run_app", "main"),  # hydra.main(...)(task): the task is run_in_hydra's
    ("rlhf/cli.py", "run_in_hydra", "execute"),
    ("rlhf/run.py", "execute", "run"),
    ("rlhf/run.py", "run", "run"),  # loop.run: rlhf.loops.<algo.kind>
    ("rlhf/loops/rl.py", "run", "scatter_update"),
    ("rlhf/loops/rl.py", "scatter_update", "scatter_async"),
    ("rlhf/launch/group.py", "ActorGroup.scatter_async", "remote"),
    ("rlhf/launch/group.py", "Host.call", "workers"),  # the colocated host (CPU hybrid) calls its worker
    ("rlhf/workers/policy.py", "PolicyWorker.update", "policy_loss_terms"),
    ("rlhf/algos/objective.py", "Objective.policy_loss_terms", "policy_loss"),
    ("rlhf/algos/losses.py", "clipped_policy_loss", "policy_loss"),
]


def _function(path: str, qualname: str) -> ast.AST:
    tree = ast.parse((ROOT / path).read_text())
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def test_each_hop_calls_the_next():
    for path, fn, callee in HOPS:
        assert callee in _names(_function(path, fn)), f"{path}:{fn} no longer uses {callee}"


def test_the_doc_lists_the_files_in_stack_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## One GRPO step, from `rlhf-run` to the loss", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)
    on_stack = list(dict.fromkeys(path for path, _, _ in HOPS))
    assert listed == on_stack
    assert len(listed) <= 8


def _measured_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("## The executed path of one GRPO step, measured", 1)[1].split("\n## ", 1)[0]


def test_the_doc_counts_its_measured_list():
    section = _measured_section()
    listed = re.findall(r"^- `(rlhf/[^`]+)`", section, flags=re.M)
    assert f"{len(listed)} files" in section and len(set(listed)) == len(listed)
    assert all((ROOT / f).is_file() for f in listed)


@pytest.mark.slow
def test_the_measured_path_is_the_documented_one(rlhf_cache, tmp_path):
    """Runs three steps traced (bench/step_path.py, about two minutes on two cores)."""
    from bench.step_path import measure

    listed = set(re.findall(r"^- `(rlhf/[^`]+)`", _measured_section(), flags=re.M))
    assert set(measure([], tmp_path)) == listed
