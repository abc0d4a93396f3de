"""scripts/engines_gpu.sh's runs, with a stand-in Python that records each call (no GPU, no vLLM): the
variants' order, engines per device and the nested-log-probs plugin for an "n" variant."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_variants_become_runs_in_their_order(tmp_path):
    calls = tmp_path / "calls"
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    stub.chmod(0o755)
    env = {**os.environ, "PY": str(stub), "VARIANTS": "1n 2n 2", "STEPS": "3",
           "EXTRA_ARGS": "rollout.max_response_tokens=512", "RUNS_DIR": str(tmp_path / "runs"), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "engines_gpu.sh"), "qwen2.5-0.5b"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("-m bench.make_model qwen2.5-0.5b")
    runs = [line for line in lines if line.startswith("-m rlhf.cli") and "--plan" not in line]
    assert len(runs) == 3
    for line, (n, nested) in zip(runs, ((1, True), (2, True), (2, False))):
        assert f"placement.rollout.engines_per_device={n} " in line and "train.steps=3" in line
        assert "rollout.max_response_tokens=512" in line
        assert ("rollout.engine=vllm_nested rollout.plugins=[bench.vllm_nested]" in line) is nested
    assert [line.split("output_dir=")[1] for line in runs] == [str(tmp_path / "runs" / f"engines-qwen2.5-0.5b-{v}")
                                                               for v in ("e1n", "e2n", "e2")]
    report = lines[-1].split()
    assert report[:2] == ["-m", "bench.engines_report"] and [r.rsplit("-", 1)[1] for r in report[2:]] == ["e1n", "e2n", "e2"]
