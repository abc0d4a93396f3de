"""``bench.mismatch --cpu-test``: the log-prob mismatch report on CPU (tiny model, HF sampling,
float32 paths against the float64 reference). The GPU run (vLLM, bf16) uses the same code."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))


def test_cpu_report(tmp_path, monkeypatch):
    from bench import mismatch

    monkeypatch.setenv("RLHF_GPU_OUT", str(tmp_path / "out"))
    models = tmp_path / "models"
    assert mismatch.main(["--cpu-test", "--models-dir", str(models), "--out", str(tmp_path / "r.json")]) == 0

    report = json.loads((tmp_path / "r.json").read_text())
    assert report == json.loads((tmp_path / "out" / "bench_mismatch.json").read_text())
    row = report["presets"]["tiny"]
    assert row["tokens"] == 6 * 12 and row["dtype"] == "float32" and row["ref_dtype"] == "float64"
    assert set(row["vs_ref"]) == {"engine", "trainer", "trainer_wide_head", "trainer_sdpa", "hf_padded"}
    assert {"engine-trainer", "trainer-hf_padded", "trainer-trainer_sdpa"} <= set(row["pairs"])
    # every path is float32 noise away from float64: the trainer's packing, varlen attention and
    # chunked head score the sampled tokens at the right positions (a shifted token would be ~1 nat off)
    for name, s in row["vs_ref"].items():
        assert s["max"] < 2e-5, (name, s)
    assert row["pairs"]["engine-trainer"]["max"] < 2e-5
    m = row["model"]
    assert 0 < m["entropy"] <= math.log(22) + 1e-9 and m["logit_std"] > 0 and m["sampled_logp"] < 0
    assert len(m["layer_rel_err"]) == 3 and all(0 <= e < 1e-5 for e in m["layer_rel_err"])
    for key in ("by_position", "by_entropy", "by_sampled_logit"):
        assert sum(b["n"] for b in row[key]) == row["tokens"]
        assert all(set(b) >= {"lo", "hi", "n", "engine", "trainer", "trainer_wide_head", "hf_padded"} for b in row[key])
    assert not (models / "tiny-random").exists()  # each model dir is deleted after its preset
    results = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert json.loads(results[-1])["name"] == "mismatch_tiny"
