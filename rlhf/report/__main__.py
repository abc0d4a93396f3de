"""``rlhf-report RUN_DIR`` (or ``python -m rlhf.report RUN_DIR``): draw a run's report again, from
its metrics.jsonl, during the run or after it."""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pathlib import Path

    from rlhf.report.render import write_report

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: rlhf-report RUN_DIR   (writes RUN_DIR/report/report.png and report.html)",
              file=sys.stderr if len(args) != 1 else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    run_dir = Path(args[0])
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"error: {run_dir} has no metrics.jsonl. Give a run dir (outputs/<date>/<time>, the one "
              "holding metrics.jsonl and spec.yaml).", file=sys.stderr)
        return 2
    try:
        files = write_report(run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {files.html}\n        {files.png}")
    return 0


def entrypoint() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    entrypoint()
