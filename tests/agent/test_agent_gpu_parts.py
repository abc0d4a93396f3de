"""The CPU-checkable parts of the GPU agent recipe (scripts/agent_gpu.sh): the slow lookup tool of
its third run (bench/agent_tools.py) and its report (bench/agent_report.py). The script's stages
themselves run on CPU with ``AGENT_GPU_CPU=1 bash scripts/agent_gpu.sh`` (minutes; not a test)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest


def test_the_slow_lookup_answers_as_builtin_lookup_and_waits_on_one_call_in_n(monkeypatch):
    from bench import agent_tools
    from rlhf.agent.builtin_tools import load_tools
    from rlhf.agent.parsers import ToolCall
    from rlhf.agent.tools import ToolSet
    from rlhf.data.builtin import table

    monkeypatch.setenv("RLHF_SLOW_TOOL_EVERY", "3")
    monkeypatch.setenv("RLHF_SLOW_TOOL_S", "0.5")
    monkeypatch.setattr(agent_tools, "_calls", __import__("itertools").count())
    slow, builtin = load_tools(["bench.agent_tools:lookup"]), load_tools(["builtin:lookup"])
    # the same name and schema: a prompt offering it renders as one offering builtin:lookup
    assert slow[0].schema() == builtin[0].schema()
    tools = ToolSet(slow, threads=1)

    async def six():
        t0 = time.monotonic()
        outs = await asyncio.gather(*[tools.call(ToolCall("lookup", {"key": f"k{i}"})) for i in range(6)])
        return outs, time.monotonic() - t0

    outs, wall = asyncio.run(six())
    tools.close()
    assert [o.content for o in outs] == [table()[f"k{i}"] for i in range(6)]
    waited = [o.latency_s >= 0.5 for o in outs]
    assert sum(waited) == 2, [o.latency_s for o in outs]  # 2 of 6 calls waited 0.5 s
    assert max(o.latency_s for o, w in zip(outs, waited) if not w) < 0.4
    # the two waits overlap (async: no tool thread held), not one after the other
    assert wall < 0.95, wall


def _write(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_gain_margin_and_step_times(tmp_path, capsys):
    from bench import agent_report

    steps = [{"step": n, "reward/mean": 0.5 + n / 100, "time/step": 9.0 if n == 1 else 1.0 + n / 10,
              "time/generate": 0.5, "agent/tool_calls_mean": 1.0, "agent/tool_latency_p99": 0.01} for n in range(1, 9)]
    steps[0].update({"eval_before/sampled/reward_mean": 0.55, "eval_before/greedy/reward_mean": 0.9})
    steps[-1].update({"eval/sampled/reward_mean": 0.70, "eval/greedy/reward_mean": 1.0,
                      "mismatch/logp_abs_mean": 0.002})
    _write(tmp_path / "lookup", steps)
    _write(tmp_path / "slow", [{**r, "time/step": r["time/step"] + 2.0} for r in steps[:6]])
    out = agent_report.report(tmp_path, margin=0.10)
    L = out["learning"]
    assert L["gain"] == pytest.approx(0.15) and L["passed"]
    assert out["timing"]["lookup"]["steps"] == [2, 3, 4, 5, 6]
    assert out["timing"]["lookup"]["s_per_step"] == pytest.approx(1.4)  # median of 1.2 .. 1.6; step 1 left out
    assert out["timing"]["slow"]["s_per_step"] == pytest.approx(3.4)
    assert out["timing"]["notools"]["s_per_step"] is None  # the run did not happen
    assert agent_report.report(tmp_path, margin=0.20)["learning"]["passed"] is False
    summary = tmp_path / "summary.json"
    assert agent_report.main([str(tmp_path), "--margin", "0.1", "--json", str(summary),
                              "--stages", "sft=0 lookup=0 notools=skipped slow=0"]) == 0
    assert json.loads(summary.read_text())["stages"]["notools"] == "skipped"
    assert agent_report.main([str(tmp_path), "--margin", "0.2"]) == 1
    assert "RESULT" in capsys.readouterr().out
