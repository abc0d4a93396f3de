"""rlhf.data.files: formats, mixing, splits and the errors users see."""

from __future__ import annotations

import json

import pytest

from rlhf.data import files
from rlhf.spec.errors import UserError

ROWS = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(10)]


def _write_all(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    out["jsonl"] = p
    p = tmp_path / "a.json"
    p.write_text(json.dumps(ROWS))
    out["json"] = p
    p = tmp_path / "cols.json"
    p.write_text(json.dumps({"prompt": [r["prompt"] for r in ROWS], "response": [r["response"] for r in ROWS]}))
    out["json_columns"] = p
    p = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), p)
    out["parquet"] = p
    p = tmp_path / "a.csv"
    p.write_text("prompt,response\n" + "".join(f"{r['prompt']},{r['response']}\n" for r in ROWS))
    out["csv"] = p
    return out


def test_every_format_loads_the_same_rows(tmp_path):
    for fmt, path in _write_all(tmp_path).items():
        rec = files.load_file(str(path))
        assert rec.rows == ROWS, fmt


def test_saved_hf_dataset_offline(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert files.load_file(str(tmp_path / "ds")).rows == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]), "test": datasets.Dataset.from_list(ROWS[4:])}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert files.load_file(str(tmp_path / "dd")).rows == ROWS[:4]
    assert files.load_file(str(tmp_path / "dd") + "::test").rows == ROWS[4:]


def test_builtin_task_file():
    rec = files.load_file("builtin:keymap/eval")
    assert len(rec) > 0 and {"prompt", "answer"} <= set(rec.rows[0])
    assert {"prompt", "response"} <= set(files.load_file("builtin:keymap-sft/train").rows[0])
    assert {"prompt", "chosen", "rejected"} <= set(files.load_file("builtin:keymap-preference/eval").rows[0])
    with pytest.raises(UserError, match="not a built-in data set"):
        files.load_file("builtin:keymap-nope/train")


@pytest.mark.parametrize("name,content,match", [
    ("nope.jsonl", None, r"does not exist.*data.train_files"),
    ("empty.jsonl", "\n", r"empty.jsonl is empty"),
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n', r"bad.jsonl, line 2: not valid JSON"),
    ("x.txt", "hi", r"unknown format"),
    ("notobj.jsonl", '{"a": 1}\n[1, 2]\n', r"notobj.jsonl, row 1: expected an object"),
])
def test_bad_files_name_file_line_and_fix(tmp_path, name, content, match):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=match):
        files.load_file(str(tmp_path / name))


def test_errors_name_file_row_and_fix(tmp_path):
    p = tmp_path / "prefs.jsonl"
    p.write_text('{"prompt": "a", "better": "b", "worse": "c"}\n')
    rec = files.load_file(str(p))
    with pytest.raises(UserError, match=r"prefs.jsonl, row 0: no key 'chosen' \(keys: prompt, better, worse\)\. Set data.chosen_key="):
        files.row_value(rec, 0, "chosen", spec_key="chosen_key")
    p.write_text('{"prompt": "a", "chosen": 3, "rejected": "c"}\n')
    rec = files.load_file(str(p))
    with pytest.raises(UserError, match=r"row 0: 'chosen' should be a string.*got int"):
        files.row_value(rec, 0, "chosen", spec_key="chosen_key")


def test_mix_by_weights_and_origins(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"src": "a", "i": i}) + "\n" for i in range(30)))
    b.write_text("".join(json.dumps({"src": "b", "i": i}) + "\n" for i in range(10)))
    rec = files.load_files([str(a), str(b)], [1.0, 3.0], seed=1)
    assert len(rec) == 40
    n_b = sum(r["src"] == "b" for r in rec.rows)
    assert n_b == 30  # b is repeated three times to take 3/4 of the mix
    assert sum(r["src"] == "a" for r in rec.rows) == 10
    j = next(k for k, r in enumerate(rec.rows) if r["src"] == "b")
    assert rec.where(j) == f"data file {b}, row {rec.rows[j]['i']}"
    # no weights: plain concatenation
    assert len(files.load_files([str(a), str(b)])) == 40
    with pytest.raises(UserError, match="one per file"):
        files.load_files([str(a), str(b)], [1.0])


def test_split_eval_is_disjoint_and_reproducible(tmp_path):
    rec = files.Records(rows=[{"i": i} for i in range(50)], source="x")
    tr, ev = files.split_eval(rec, 0.2, seed=3)
    assert len(ev) == 10 and len(tr) == 40
    assert {r["i"] for r in tr.rows}.isdisjoint({r["i"] for r in ev.rows})
    assert files.split_eval(rec, 0.2, seed=3)[1].rows == ev.rows
    with pytest.raises(UserError, match="too few"):
        files.split_eval(files.Records(rows=[{"i": 0}], source="x"), 0.5)
