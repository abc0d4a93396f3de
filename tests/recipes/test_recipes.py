"""Recipes (``recipes/*.yaml``): every one plans cleanly, every CPU one runs at toy size.

Planning is ``tests/cli/test_cli_main.py::test_every_recipe_plans`` (each recipe, ``--plan``).
The CPU recipes are run where a run of them already serves other assertions, so that no recipe
costs a cluster start of its own:

    grpo_tiny                     tests/reliability/test_faults.py (Ctrl-C, then resume= to the end)
    dpo_tiny                      tests/pref/test_pref_pipeline.py::test_dpo_preference_accuracy
    pipeline_sft/_rm/_ppo         tests/pref/test_pref_pipeline.py (the module's pipeline fixture,
                                  each stage reading the previous one's final/hf)
    grpo_tiny_optuna              tests/cli/test_cli_hydra.py (an Optuna search of 4 trials, in MLflow)
    agent_sft_tiny/_lookup/_code  tests/agent/test_agent_recipes.py (the SFT stage a module fixture,
                                  each GRPO stage a learning test)

The test here (no Ray, about a second) finds the CPU recipes by composing every recipe and fails
when one has no run in that table, or the named test no longer runs it. Another composes every
recipe with and without its own keys: a recipe holds only what differs from the defaults that its
defaults list gives (model_defaults/<model>.yaml included, since it follows the model choice).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from omegaconf import OmegaConf

from rlhf import cli
from rlhf.paths import recipes_dir

ROOT = Path(__file__).resolve().parents[2]
RUNS = {  # CPU recipe -> (test file, test function or fixture that runs it with recipe=<name>)
    "grpo_tiny": ("tests/reliability/test_faults.py",
                  "test_ctrl_c_checkpoints_the_step_exits_130_leaves_no_ray_process_and_resumes"),
    "dpo_tiny": ("tests/pref/test_pref_pipeline.py", "test_dpo_preference_accuracy"),
    "pipeline_sft": ("tests/pref/test_pref_pipeline.py", "pipeline"),
    "pipeline_rm": ("tests/pref/test_pref_pipeline.py", "pipeline"),
    "pipeline_ppo": ("tests/pref/test_pref_pipeline.py", "pipeline"),
    "grpo_tiny_optuna": ("tests/cli/test_cli_hydra.py", "optuna_sweep"),
    "agent_sft_tiny": ("tests/agent/test_agent_recipes.py", "agent_dir"),
    "agent_lookup_tiny": ("tests/agent/test_agent_recipes.py", "test_lookup_tool_recipe_learns"),
    "agent_code_tiny": ("tests/agent/test_agent_recipes.py", "test_code_recipe_learns_from_sandboxed_tests"),
}


def _accelerator(recipe: str) -> str:
    spec = cli.build_spec(cli.compose([f"recipe={recipe}"]), [f"recipe={recipe}"], plan=True)
    return spec.hardware.accelerator


def _strings_in(fn: ast.AST) -> str:
    """Every string constant (f-string parts included) in a function's body, joined."""
    return " ".join(n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def test_every_cpu_recipe_has_a_run():
    cpu = sorted(r for r in cli.group_options("recipe") if _accelerator(r) == "cpu")
    assert cpu, "no CPU recipe found"
    missing = [r for r in cpu if r not in RUNS]
    assert not missing, f"CPU recipes without a toy-size run: {missing}; run each in a test, add it to RUNS"
    assert sorted(RUNS) == cpu, f"RUNS names recipes that are not CPU recipes: {sorted(set(RUNS) - set(cpu))}"


@pytest.mark.parametrize("recipe", sorted(RUNS))
def test_the_named_test_runs_the_recipe(recipe):
    path, name = RUNS[recipe]
    tree = ast.parse((ROOT / path).read_text())
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(fns) == 1, f"{path} has no function {name}"
    text = _strings_in(fns[0])
    # recipe=<name> literally, or recipe=pipeline_{stage} over the stages (tests/pref's pipeline fixture)
    stem, _, stage = recipe.rpartition("_")
    assert f"recipe={recipe}" in text or (f"recipe={stem}_" in text and f"{stage}" in text.split()), \
        (path, name, recipe)


def _leaves(node: dict, path: tuple = ()):
    """The key paths of a recipe's body (lists are values; keys may hold dots, e.g. sweeper params)."""
    for k, v in node.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, path + (k,))
        else:
            yield path + (k,)


def _at(cfg: dict, path: tuple):
    for k in path:
        if not isinstance(cfg, dict) or k not in cfg:
            return KeyError  # absent: differs from any value the recipe sets
        cfg = cfg[k]
    return cfg


@pytest.mark.parametrize("recipe", cli.group_options("recipe"))
def test_a_recipe_sets_only_what_differs_from_its_defaults(recipe):
    body = OmegaConf.to_container(OmegaConf.load(recipes_dir() / f"{recipe}.yaml"))
    # the recipe's own group choices (override /algo: dpo -> algo=dpo), without its keys
    groups = [f"{k.replace('override', '').strip().strip('/')}={v}" for d in body.pop("defaults", []) for k, v in d.items()]
    plain = OmegaConf.to_container(cli.compose(groups), resolve=False)
    full = OmegaConf.to_container(cli.compose([f"recipe={recipe}"]), resolve=False)
    same = [".".join(p) + f"={_at(full, p)!r}" for p in _leaves(body) if _at(full, p) == _at(plain, p)]
    assert not same, f"recipes/{recipe}.yaml sets keys to the value its defaults give already; remove: {same}"
