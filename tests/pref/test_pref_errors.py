"""Data problems of sft/rm/dpo runs stop `rlhf-run` in the driver with one line and exit code 2,
before Ray or any worker starts."""

from __future__ import annotations

import json

import pytest

from rlhf.cli import main


@pytest.fixture
def no_ray():
    """The run must fail before it starts Ray, or, where this test process already holds a Ray
    (another module's session fixture), before it creates any actor or placement group."""
    import ray

    if not ray.is_initialized():
        yield
        assert not ray.is_initialized(), "the run started Ray before finding the data error"
        return
    from ray._private import state

    actors, pgs = set(state.actors()), set(ray.util.placement_group_table())
    yield
    assert set(state.actors()) == actors, "the run started workers before finding the data error"
    assert set(ray.util.placement_group_table()) == pgs, "the run reserved resources before finding the data error"


def _err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_rl_prompt_set_for_sft_names_the_builtin_sft_set(tmp_path, capsys, no_ray):
    assert main(["algo=sft", "tracking=none", f"output_dir={tmp_path}"]) == 2
    err = _err(capsys)
    assert "no key 'response'" in err and "builtin:keymap-sft/train" in err


def test_bad_preference_rows(tmp_path, capsys, no_ray):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"prompt": "key k1", "chosen": "v1", "rejected": "v2"}) + "\n"
                   + json.dumps({"prompt": "key k2", "chosen": ["v1"], "rejected": "v2"}) + "\n")
    args = ["algo=dpo", "tracking=none", f"output_dir={tmp_path / 'run'}", f"data.train_files=[{bad}]",
            "data.eval_files=[]", "algo.eval_fraction=0.5"]
    assert main(args) == 2
    err = _err(capsys)
    assert f"data file {bad}, row 1" in err and "'chosen'" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["algo=rm", "tracking=none", f"output_dir={tmp_path / 'run2'}", f"data.train_files=[{empty}]"]) == 2
    assert "is empty" in _err(capsys)


def test_too_little_data_for_one_step(tmp_path, capsys, no_ray):
    args = ["algo=rm", "tracking=none", f"output_dir={tmp_path}", "data.train_files=[builtin:keymap-preference/eval]",
            "data.eval_files=[builtin:keymap-preference/eval]", "train.prompts_per_step=512", "train.micro_batch_size=64"]
    assert main(args) == 2
    assert "fewer than one optimizer step takes (train.prompts_per_step=512)" in _err(capsys)
