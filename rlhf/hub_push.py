"""Publish a run's model: ``final/hf`` to the Hub repo ``checkpoint.push_to_hub`` (org/name).

One commit through ``huggingface_hub.HfApi.upload_folder`` of a staging folder that links (never
copies) the run's files:

    <repo>/            final/hf: config, weights, tokenizer
    <repo>/adapter/    final/adapter, when the policy was trained with LoRA (rlhf.models.lora)
    <repo>/report.png  the run report, when there is one (rlhf/report)
    <repo>/README.md   a model card: the base model, the algorithm, the steps, the last rewards

The repo is created when missing (``checkpoint.hub_private``; an existing one keeps its
visibility). The token is huggingface_hub's own (HF_TOKEN or ``hf auth login``); HF_ENDPOINT points
at another Hub. Nothing here changes the run dir: an upload that fails (no token, refused, the
network) is one line naming the cause and the command that retries it, ``rlhf-push RUN_DIR REPO``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from rlhf.spec.runspec import RunSpec


def _card(run_dir: Path, repo: str) -> str:
    import yaml

    spec = yaml.safe_load((run_dir / "spec.yaml").read_text()) if (run_dir / "spec.yaml").is_file() else {}
    model = spec.get("model") or {}
    base = str(model.get("path") or model.get("name") or "unknown")
    algo = (spec.get("algo") or {}).get("name", "unknown")
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    last = rows[-1] if rows else {}
    figures = "\n".join(f"| {k} | {last[k]:.4g} |" for k in ("reward/mean", "kl/mean", "train/loss",
                                                            "eval/greedy/reward_mean") if k in last)
    meta = {"library_name": "transformers", "tags": ["rlhf", algo]}
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base) and not Path(base).exists():  # a Hub id, not a local dir
        meta["base_model"] = base
    card = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {repo}", "",
            f"Trained from `{base}` with `{algo}` by the `rlhf` framework, {len(rows)} steps."]
    if (run_dir / "final" / "adapter").is_dir():
        card += ["", "`adapter/` holds the LoRA adapter (peft); the repo root holds the merged weights."]
    if figures:
        card += ["", "Last step:", "", "| metric | value |", "| --- | --- |", figures]
    if (run_dir / "report" / "report.png").is_file():
        card += ["", "![the run's curves](report.png)"]
    return "\n".join(card) + "\n"


def _stage(run_dir: Path, repo: str, into: Path) -> None:
    """The repo's tree as symlinks to the run's files (upload_folder reads through them)."""
    hf = run_dir / "final" / "hf"
    for src in hf.rglob("*"):
        if src.is_file():
            dst = into / src.relative_to(hf)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src.resolve())
    adapter = run_dir / "final" / "adapter"
    if adapter.is_dir():
        for src in adapter.rglob("*"):
            if src.is_file():
                dst = into / "adapter" / src.relative_to(adapter)
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src.resolve())
    report = run_dir / "report" / "report.png"
    if report.is_file():
        (into / "report.png").symlink_to(report.resolve())
    (into / "README.md").write_text(_card(run_dir, repo))


def push(run_dir: str | os.PathLike, repo: str, private: bool = True) -> str:
    """Upload the run's final model to ``repo``; the commit's URL. Raises what huggingface_hub raises."""
    from huggingface_hub import HfApi

    run_dir = Path(run_dir)
    if not (run_dir / "final" / "hf").is_dir():
        raise FileNotFoundError(f"{run_dir / 'final' / 'hf'} does not exist (the run has not finished)")
    import logging

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry notices ("HTTP Error 500 ... Retrying in 8s"): the outcome is our line
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rlhf-push-") as tmp:
            _stage(run_dir, repo, Path(tmp))
            info = api.upload_folder(repo_id=repo, folder_path=tmp,
                                     commit_message=f"rlhf: {run_dir.resolve().name} final model")
    finally:
        hub_log.setLevel(level)
    return str(getattr(info, "commit_url", info))


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


def push_at_end(spec: RunSpec, run_dir: str | os.PathLike, say: Callable[[str], Any]) -> Optional[str]:
    """The end of a run with ``checkpoint.push_to_hub``: push, and one line either way."""
    repo = spec.checkpoint.push_to_hub
    if not repo:
        return None
    try:
        url = push(run_dir, repo, private=spec.checkpoint.hub_private)
    except Exception as e:  # noqa: BLE001 - the run has succeeded; its export stays where it is
        say(f"warning: the upload to the Hub ({repo}) failed ({_reason(e)}); the model is intact in "
            f"{Path(run_dir) / 'final' / 'hf'}. Retry: rlhf-push {run_dir} {repo}")
        return None
    say(f"pushed to the Hub: {url}")
    return url


def main(argv: Optional[list[str]] = None) -> int:
    """``rlhf-push RUN_DIR ORG/NAME [--public]``: upload a finished run's final model."""
    args = list(sys.argv[1:] if argv is None else argv)
    public = "--public" in args
    args = [a for a in args if a != "--public"]
    if len(args) != 2:
        print("usage: rlhf-push RUN_DIR ORG/NAME [--public]   (uploads RUN_DIR/final/hf, and final/adapter)",
              file=sys.stderr)
        return 2
    try:
        url = push(args[0], args[1], private=not public)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(f"error: the upload to the Hub ({args[1]}) failed ({_reason(e)}); {args[0]} is unchanged.",
              file=sys.stderr)
        return 1
    print(f"pushed to the Hub: {url}")
    return 0


def entrypoint() -> None:
    raise SystemExit(main())
