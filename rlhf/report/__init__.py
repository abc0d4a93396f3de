"""The run report: the run's curves in one PNG and an HTML page, ``<run dir>/report/``.

Written at the end of every run (``report_at_end``, also stored as MLflow artifacts under
``report/``) and on demand: ``rlhf-report RUN_DIR`` (or ``python -m rlhf.report RUN_DIR``),
which reads only the run dir (metrics.jsonl, and report/plan_memory.json when the run wrote it).
``panels.py`` says what each panel shows and where its numbers come from; ``render.py`` draws them
with matplotlib (Agg: no display needed).
"""

from rlhf.report.render import ReportFiles, report_at_end, write_report

__all__ = ["ReportFiles", "report_at_end", "write_report"]
