"""An sft/rm/dpo run's checkpoints counted from its data (rlhf.plan.disk.supervised_steps): the
rows of its training files counted without reading them whole (rlhf.data.files.count_rows,
rows_bound) against what the loaders read, the step bound against the steps the loops' own data
path gives, and the plan and the start-of-run check fitting a disk with the count where rotation's
worst case does not. The run that writes the counted checkpoints: tests/pref/test_pref_pipeline.py."""

from __future__ import annotations

import csv
import gzip
import json
import re
from pathlib import Path

import pytest

from rlhf import cli, storage
from rlhf.data import files
from rlhf.plan import disk
from rlhf.spec.errors import UserError
from rlhf.plan.memory import GB
from tests.helpers import planned_spec

ROWS = [{"prompt": f"p{i}", "response": f"r{i}", "chosen": f"c{i}", "rejected": f"x{i}"} for i in range(7)]


def _jsonl(path: Path, rows: list[dict], blank: bool = True) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank:  # blank and whitespace-only lines are no rows
        lines = ["", *lines[:3], "   ", *lines[3:], ""]
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _formats(tmp: Path) -> list[Path]:
    """The rows of ROWS in every format rlhf.data.files reads from a local file."""
    out = [_jsonl(tmp / "a.jsonl", ROWS), _jsonl(tmp / "a.jsonl.gz", ROWS)]
    (tmp / "list.json").write_text(json.dumps(ROWS))
    (tmp / "data.json").write_text(json.dumps({"data": ROWS}))
    (tmp / "cols.json").write_text(json.dumps({k: [r[k] for r in ROWS] for k in ROWS[0]}))
    out += [tmp / "list.json", tmp / "data.json", tmp / "cols.json"]
    for name, delim in (("a.csv", ","), ("a.tsv", "\t")):
        with open(tmp / name, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(ROWS[0]), delimiter=delim)
            w.writeheader()
            w.writerows([{**r, "response": "two\nlines"} if i == 2 else r for i, r in enumerate(ROWS)])
            f.write("\r\n")  # an empty record: no row
        out.append(tmp / name)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp / "a.parquet", row_group_size=3)
    return out + [tmp / "a.parquet"]


def test_rows_are_counted_as_the_loaders_read_them(tmp_path):
    for path in _formats(tmp_path):
        assert files.count_rows(str(path)) == len(files.load_file(str(path))) == len(ROWS), path.name


def test_what_is_not_cheap_or_not_local_is_not_counted(tmp_path, rlhf_cache):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert len(files.load_file(str(tmp_path / "saved"))) == len(ROWS)  # readable, but not counted cheaply
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "a.txt").write_text("x\n")
    for name in (str(tmp_path / "saved"), f"{tmp_path / 'saved'}::train", "hub:org/name:train",
                 str(tmp_path / "missing.jsonl"), str(tmp_path / "bad.json"), str(tmp_path / "a.txt"),
                 "builtin:keymap-nothing/train"):
        assert files.count_rows(name) is None, name
    # a built-in set is a local file of the cache (made on first use, as the run would)
    assert files.count_rows("builtin:keymap-sft/eval") == len(files.load_file("builtin:keymap-sft/eval")) == 128
    assert files.rows_bound([str(_jsonl(tmp_path / "a.jsonl", ROWS)), "hub:org/name:train"]) is None


def test_a_file_changed_is_counted_again(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", ROWS)
    assert files.count_rows(str(path)) == 7
    _jsonl(path, ROWS + ROWS, blank=False)
    assert files.count_rows(str(path)) == 14


@pytest.mark.parametrize("sizes,weights", [
    ((4, 3), [1, 1]),  # 3.5 + 3.5 rounds to 8 rows of 7
    ((1, 1, 1), [1, 1, 2]),  # 0.75, 0.75, 1.5 round to 4 of 3
    ((3, 3, 4), [0.5, 0.5, 2]),
    ((5, 2), [0, 1]),
    ((5, 2), None),  # concatenated
])
def test_a_mix_by_weights_is_within_the_bound(tmp_path, sizes, weights):
    paths = [str(_jsonl(tmp_path / f"f{k}.jsonl", ROWS[:n], blank=False)) for k, n in enumerate(sizes)]
    mixed = len(files.load_files(paths, weights))
    bound = files.rows_bound(paths, weights)
    assert mixed <= bound <= sum(sizes) + len(sizes) // 2, (mixed, bound)
    if sizes in ((4, 3), (1, 1, 1)):
        assert mixed > sum(sizes)  # the rounding's slack is needed


# ----------------------------------------------------------------------------- the loops' own steps


def _loop_steps(spec) -> int:
    """The optimizer steps the run would take: its loop's own data path (read, tokenise, pack)."""
    from rlhf.data.sft import to_rows
    from rlhf.loops import sft, supervised as sup

    if spec.algo.kind == "sft":
        prepared = sft.prepare(spec)
        n = len(to_rows(prepared.train, pack=spec.algo.packing, max_length=prepared.max_length))
    else:
        n = len(sup.prepare_pairs(spec).train)
    return sup.total_steps(spec, sup.check_enough(n, spec, "units"))


@pytest.fixture(scope="module")
def sets(tmp_path_factory, rlhf_cache) -> dict[str, Path]:
    from rlhf.data.make import make

    out = {}
    for kind in ("sft", "preference"):
        out[kind] = make(kind, tmp_path_factory.mktemp(kind), n_train=64, n_eval=16)["train"]
    rows = [json.loads(x) for x in out["sft"].read_text().splitlines()]
    for r in rows[::4]:  # a quarter too long for data.max_length=5
        r["response"] += " v1 v2 v3"
    out["sft-long"] = _jsonl(tmp_path_factory.mktemp("long") / "train.jsonl", rows, blank=False)
    return out


@pytest.mark.parametrize("algo,extra", [
    ("sft", ["train.prompts_per_step=16", "algo.epochs=3"]),
    ("sft", ["train.prompts_per_step=8", "algo.packing=true"]),  # packed rows: fewer units than rows
    ("sft-long", ["train.prompts_per_step=16", "data.truncation=drop", "data.max_length=5"]),  # rows dropped
    ("dpo", ["train.prompts_per_step=16", "algo.epochs=2"]),
    ("rm", ["train.prompts_per_step=8"]),
])
@pytest.mark.parametrize("held_out", ["eval_files", "eval_fraction"])
def test_the_step_bound_is_at_least_the_runs_steps(sets, algo, extra, held_out):
    train = sets[algo if algo.startswith("sft") else "preference"]
    held = [f"data.eval_files=[{train}]"] if held_out == "eval_files" else ["data.eval_files=[]",
                                                                        "algo.eval_fraction=0.25"]
    spec = planned_spec([f"algo={algo[:3]}", f"data.train_files=[{train}]", *held, "checkpoint.every=1", *extra])
    bound = disk.supervised_steps(spec)
    steps = _loop_steps(spec)
    assert bound.rows == 64 and bound.steps == 64 // spec.batch.mini_batch_size * spec.algo.epochs
    assert steps <= bound.steps and disk.need(spec).saves == bound.steps, (steps, bound)
    fewer = held_out == "eval_fraction" or algo == "sft-long" or "algo.packing=true" in extra
    assert (steps < bound.steps) == fewer, (steps, bound)  # else every row a unit: the bound is the count


def test_a_mixed_set_takes_the_steps_its_rounding_adds(tmp_path, sets):
    """16 + 15 rows at equal weights mix to 32 (15.5 rounds up twice): 4 steps of 8, one more than
    the files' 31 rows make; the bound has them."""
    rows = [json.loads(x) for x in Path(sets["sft"]).read_text().splitlines()]
    a = _jsonl(tmp_path / "a.jsonl", rows[:16], blank=False)
    b = _jsonl(tmp_path / "b.jsonl", rows[16:31], blank=False)
    spec = planned_spec(["algo=sft", f"data.train_files=[{a},{b}]", "data.weights=[1,1]", f"data.eval_files=[{a}]",
                         "train.prompts_per_step=8", "checkpoint.every=1"])
    assert _loop_steps(spec) == 4 == disk.supervised_steps(spec).steps


def test_not_counted_and_rl_keep_their_rules(sets):
    hub = planned_spec(["algo=sft", "data.train_files=[hub:org/name:train]", "checkpoint.every=1"])
    assert disk.supervised_steps(hub) is None and disk.need(hub).saves is None
    assert disk.need(hub).checkpoints == hub.checkpoint.keep_last + 1
    rl = planned_spec(["train.steps=5", "checkpoint.every=2"])
    assert disk.supervised_steps(rl) is None and disk.need(rl).saves == 3
    once = planned_spec(["algo=sft", f"data.train_files=[{sets['sft']}]", "checkpoint.every=0"])
    assert disk.need(once).saves == 1 and disk.need(once).steps is None  # no count needed


# ----------------------------------------------------------------------------- the plan and the check

BIG = ["model=qwen2.5-1.5b", "hardware=1xh200", "train.prompts_per_step=16", "algo.epochs=1", "checkpoint.every=2"]


@pytest.mark.parametrize("algo", ["sft", "dpo", "rm"])
def test_a_disk_that_fits_the_counted_checkpoints_but_not_the_worst_case(real_disk, monkeypatch, capsys, tmp_path,
                                                                          sets, algo):
    """The GPU machine's 64 GB disk, 1.5B, 64 rows, 16 a step, checkpoint.every=2: 4 steps, 2
    saves and the final export fit; the same run on rows not counted (a Hub set) plans rotation's
    3 checkpoints and is refused, by the plan and by the start-of-run check alike."""
    from rlhf.preflight import check_disk

    monkeypatch.setattr(storage, "free_bytes", lambda path: 64 * GB)
    train = sets["sft" if algo == "sft" else "preference"]
    counted = [f"algo={algo}", *BIG, f"data.train_files=[{train}]", f"data.eval_files=[{train}]",
               f"output_dir={tmp_path / 'a'}"]
    assert cli.main([*counted, "--plan"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("disk at "))
    parts = r"\(actor [\d.]+ \+ actor HF [\d.]+\) \+ final export \(actor [\d.]+\)"
    assert re.search(rf": 2 checkpoints × {parts} = ", line), line
    assert line.endswith(" of 64.0 GB free · ≤ 2 saves in ≤ 4 steps of 64 training rows"), line
    assert "does not fit" not in out and out.rstrip().endswith("✓ fits"), out
    check_disk(planned_spec(counted))

    unknown = [f"algo={algo}", *BIG, "data.train_files=[hub:org/name:train]", f"data.eval_files=[{train}]",
               f"output_dir={tmp_path / 'b'}"]
    assert cli.main([*unknown, "--plan"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("disk at "))
    assert ": 3 checkpoints × " in line and line.endswith(
        "· steps from the data, not counted before reading it: as many checkpoints as rotation keeps"), line
    assert "✗ does not fit: the disk at" in out
    with pytest.raises(UserError, match="needs ~.* \\(3 checkpoints of "):
        check_disk(planned_spec(unknown))
