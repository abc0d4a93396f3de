"""Draw the report's panels (rlhf/report/panels.py) into ``report.png`` and write ``report.html``.

matplotlib's object API with the Agg canvas (``Figure`` + ``FigureCanvasAgg``): no pyplot state,
no display, safe in a driver that also runs a progress bar. The page embeds the PNG (a data URI),
so it stays whole when copied alone (an MLflow artifact, an e-mail).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlhf.report.panels import Panel, build_panels, plan_memory_gib, read_rows
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console, Tracker

PLAN_FILE = "plan_memory.json"  # the plan's GiB per phase/role, for a report redrawn on demand


@dataclass
class ReportFiles:
    png: Path
    html: Path
    drawn: list[str]  # the panels' keys, in the image's order
    absent: list[str]  # panels without data in this run


def _short(name: str) -> str:
    return name.replace("reward/", "").replace("response/", "").replace("throughput/", "")


def _draw(ax: Any, p: Panel) -> None:
    if p.kind == "stacked":
        steps = sorted({s for pts in p.series.values() for s, _ in pts})
        bottom = {s: 0.0 for s in steps}
        for name, pts in p.series.items():
            vals = dict(pts)
            heights = [vals.get(s, 0.0) for s in steps]
            ax.bar(steps, heights, bottom=[bottom[s] for s in steps], label=name, width=0.8)
            for s, h in zip(steps, heights):
                bottom[s] += h
        if p.total:
            ax.plot([s for s, _ in p.total], [v for _, v in p.total], "k_", markersize=14, label="time/step")
    else:
        for name, pts in p.series.items():
            if name in p.left_out:
                continue
            xs, ys = [s for s, _ in pts], [v for _, v in pts]
            style = {"marker": "o", "markersize": 4} if p.kind == "markers" or len(xs) < 3 else {}
            faint = name.endswith(("/min", "/max", "_max")) and p.key in ("reward", "response_length")
            ax.plot(xs, ys, label=_short(name), linewidth=0.8 if faint else 1.5,
                    linestyle=":" if faint else "-", **style)
    for name, gib in p.plan.items():
        ax.axhline(gib, linestyle="--", linewidth=1, color="gray")
        ax.annotate(f"plan: {name} {gib:.1f}", (0.01, gib), xycoords=("axes fraction", "data"), fontsize=7,
                    color="gray", va="bottom")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(p.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(p.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if p.series and p.kind == "stacked":  # beside the bars, not over them
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    elif p.series:
        ax.legend(fontsize=7, loc="best")


def _figure(panels: list[Panel], title: str, png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(12, 3.3 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, p in zip(axes.flat, panels):
        _draw(ax, p)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=12)
    tmp = png.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(png)  # a reader never sees half an image


def _stats(p: Panel) -> str:
    rows = []
    for name, pts in p.series.items():
        vals = [v for _, v in pts]
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{len(vals)}</td><td>{vals[0]:.4g}</td>"
                    f"<td>{vals[-1]:.4g}</td><td>{min(vals):.4g}</td><td>{max(vals):.4g}</td></tr>")
    rows += [f"<tr><td>plan: {html.escape(n)}</td><td></td><td></td><td>{v:.4g}</td><td></td><td></td></tr>"
             for n, v in p.plan.items()]
    note = (f"<p>In the table, not drawn: {html.escape(', '.join(p.left_out))}</p>" if p.left_out else "")
    return ("<table><tr><th>series</th><th>points</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>"
            + "".join(rows) + "</table>" + note)


def _page(title: str, run_dir: Path, png: Path, drawn: list[Panel], absent: list[Panel], n_rows: int) -> str:
    img = base64.b64encode(png.read_bytes()).decode()
    sections = "".join(f'<section class="panel" id="panel-{p.key}"><h2>{html.escape(p.title)}</h2>{_stats(p)}</section>'
                       for p in drawn)
    missing = "".join(f'<li id="absent-{p.key}">{html.escape(p.title)}</li>' for p in absent)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1250px}} table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}} td:first-child{{text-align:left}}
img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>Run dir: <code>{html.escape(str(run_dir))}</code> · {n_rows} logged steps · redraw: <code>rlhf-report {html.escape(str(run_dir))}</code></p>
<img alt="the run's curves" src="data:image/png;base64,{img}">
<nav><ul>{''.join(f'<li><a href="#panel-{p.key}">{html.escape(p.title)}</a></li>' for p in drawn)}</ul></nav>
{sections}
<h2>Not in this run</h2><ul id="absent">{missing}</ul>
</body></html>
"""


def write_report(run_dir: str | Path, plan_gib: Optional[dict[str, float]] = None) -> ReportFiles:
    """``<run_dir>/report/report.png`` and ``report.html`` from the run dir's metrics.jsonl.
    ``plan_gib``: the plan's GPU memory (GiB per phase/role), kept beside the report for later
    redraws; None reads the kept one, if any."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} has no step yet: nothing to draw")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    kept = out / PLAN_FILE
    if plan_gib is None:
        plan_gib = json.loads(kept.read_text()) if kept.is_file() else {}
    elif plan_gib:
        kept.write_text(json.dumps(plan_gib, indent=1) + "\n")
    panels = build_panels(rows, plan_gib)
    drawn = [p for p in panels if not p.empty]
    absent = [p for p in panels if p.empty]
    title = f"{run_dir.name}: {_algo(run_dir)}, steps 1-{len(rows)}"
    png, page = out / "report.png", out / "report.html"
    _figure(drawn, title, png)
    tmp = page.with_suffix(".html.tmp")
    tmp.write_text(_page(title, run_dir.resolve(), png, drawn, absent, len(rows)))
    tmp.replace(page)
    return ReportFiles(png, page, [p.key for p in drawn], [p.key for p in absent])


def _algo(run_dir: Path) -> str:
    """The algorithm's name from spec.yaml's first lines (no YAML parse of the whole spec)."""
    spec = run_dir / "spec.yaml"
    if spec.is_file():
        import yaml

        algo = (yaml.safe_load(spec.read_text()) or {}).get("algo") or {}
        return str(algo.get("name", "run"))
    return "run"


def report_at_end(spec: RunSpec, run_dir: str | Path, tracker: Tracker, console: Console) -> Optional[ReportFiles]:
    """The end of a run: the report, its files as MLflow artifacts (``report/``), one console
    line. A report that fails says so in one line: the run itself has succeeded."""
    try:
        files = write_report(run_dir, plan_memory_gib(spec))
        for f in (files.png, files.html):
            tracker.log_artifact(str(f), "report")
    except Exception as e:  # noqa: BLE001 - a picture must not fail a finished run
        console.print(f"warning: the run report failed ({type(e).__name__}: {e}); retry: rlhf-report {run_dir}")
        return None
    console.print(f"report: {files.html}")
    return files
