"""`rlhf-data make`: synthetic SFT / preference / prompt data for the built-in task."""

from __future__ import annotations

import json

from rlhf.data import builtin as task
from rlhf.data import make
from rlhf.data.cli import main


def _read(p):
    return [json.loads(line) for line in open(p)]


def test_cli_writes_train_and_eval(tmp_path, capsys):
    for kind in make.KINDS:
        assert main(["make", kind, "--out", str(tmp_path / kind), "--n", "40", "--n-eval", "8"]) == 0
        assert len(_read(tmp_path / kind / "train.jsonl")) == 40
        assert len(_read(tmp_path / kind / "eval.jsonl")) == 8
    assert "rlhf-run algo=sft" in capsys.readouterr().out
    assert main(["make", "sft", "--out", str(tmp_path), "--noise", "2"]) == 2


def test_rows_are_reproducible_and_consistent():
    assert make.preference_rows(50, seed=1) == make.preference_rows(50, seed=1)
    for r in make.preference_rows(200, seed=1):
        assert r["chosen_score"] == task.score(r["chosen"], r["answer"]) > r["rejected_score"] == task.score(r["rejected"], r["answer"])
        keys = [w for w in r["prompt"].split() if w in task.KEYS]
        assert r["prompt"] == task.prompt_for(keys) and r["answer"] == task.answer_for(keys)
    sft = make.sft_rows(400, seed=0, noise=0.2)
    mean = sum(task.score(r["response"], r["answer"]) for r in sft) / len(sft)
    assert 0.7 < mean < 0.9  # mostly right, room left for RL
    assert all(task.score(r["response"], r["answer"]) == 1.0 for r in make.sft_rows(20, noise=0.0))
    for r in make.prompt_rows(100):
        keys = [w for w in r["prompt"].split() if w in task.KEYS]
        assert r["answer"] == task.answer_for(keys)
