"""Data sets of the Hugging Face Hub by name, in ``data.train_files`` / ``data.eval_files``:

    hub:<org>/<name>[@<revision>][:<config>]:<split>     e.g. hub:openai/gsm8k:main:train
    hub:<org>/<name>                                     the default config's train split

The repo's files for that config (from the data set card's ``configs``; every data file when the
card has none) are fetched into the HF cache like a model (``rlhf.hub.snapshot``: cache first,
HF_HUB_OFFLINE=1 the cache only), then read by ``datasets.load_dataset`` from that local snapshot
(its Arrow copy in $HF_HOME/datasets).
The rows go through the same checks as a local file's (rlhf.data.files, rlhf.preflight), and
``data.columns`` renames their columns.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlhf.spec.errors import UserError

PREFIX = "hub:"
SYNTAX = "hub:<org>/<name>[@<revision>][:<config>]:<split>, e.g. hub:openai/gsm8k:main:train"
DATA_EXTS = (".parquet", ".arrow", ".jsonl", ".json", ".csv", ".tsv", ".txt", ".jsonl.gz", ".json.gz", ".csv.gz",
             ".jsonl.zst", ".json.zst")
CARD = "README.md"


@dataclass(frozen=True)
class HubData:
    repo: str
    revision: Optional[str]
    config: Optional[str]
    split: str


def parse(name: str) -> HubData:
    """``hub:...`` → its parts (UserError with the syntax when it does not parse)."""
    from rlhf.hub import is_repo_id

    parts = name[len(PREFIX):].split(":")
    repo, _, revision = parts[0].partition("@")
    if not is_repo_id(repo) or len(parts) > 3 or any(not p for p in parts) or (parts[0].endswith("@")):
        raise UserError(f"data file {name}: not a Hub data set name. Write {SYNTAX}.")
    config = parts[1] if len(parts) == 3 else None
    split = parts[-1] if len(parts) > 1 else "train"
    return HubData(repo, revision or None, config, split)


_FETCHED: dict[HubData, str] = {}  # this process's snapshots: preflight fetches, the loop re-reads


def _configs(card: Path) -> list[dict]:
    from huggingface_hub import DatasetCard

    try:
        meta = DatasetCard.load(card).data.to_dict()
    except Exception:  # noqa: BLE001 - a card without metadata: no configs
        return []
    configs = meta.get("configs") or []
    return [c for c in configs if isinstance(c, dict) and c.get("config_name")]


def _paths(data_files: Any) -> list[str]:
    """The path patterns of a config's ``data_files`` (str, list, or [{split, path}]), every split's:
    ``datasets`` reads the whole config's layout even to return one split."""
    if isinstance(data_files, str):
        return [data_files]
    entries = [e for e in (data_files or []) if isinstance(e, (str, dict))]
    out: list[str] = []
    for e in entries:
        p = e.get("path") if isinstance(e, dict) else e
        out += [p] if isinstance(p, str) else list(p or [])
    return out


def _chooser(name: str, d: HubData):
    """The repo files to fetch: the card, and the data files of the config (all data files if the
    card names no configs). An unknown config is an error here, before any data is downloaded."""

    def choose(names: list[str], commit: str) -> list[str]:
        from huggingface_hub import hf_hub_download

        from rlhf.hub import endpoint, hub_cache

        configs = []
        if CARD in names:
            card = hf_hub_download(d.repo, CARD, repo_type="dataset", revision=commit, cache_dir=hub_cache(),
                                   endpoint=endpoint())
            configs = _configs(Path(card))
        if not configs:
            return [n for n in names if n == CARD or n.lower().endswith(DATA_EXTS)]
        by_name = {c["config_name"]: c for c in configs}
        want = d.config or next((c["config_name"] for c in configs if c.get("default")), None) or \
            ("default" if "default" in by_name else configs[0]["config_name"] if len(configs) == 1 else None)
        if want not in by_name:
            listed = ", ".join(by_name)
            example = f"hub:{d.repo}:{next(iter(by_name))}:{d.split}"
            what = f"has no config {d.config!r}" if d.config else "has several configs"
            raise UserError(f"data file {name}: {d.repo} {what} ({listed}). Name one: {example}.")
        patterns = _paths(by_name[want].get("data_files"))
        return [CARD] + [n for n in names if any(fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(n, p + "/*")
                                                 for p in patterns)]

    return choose


def fetch(name: str) -> tuple[HubData, str]:
    """``hub:...`` → (its parts, the local snapshot dir), fetched once per process."""
    from rlhf.hub import snapshot

    d = parse(name)
    if d not in _FETCHED:
        snap = snapshot(d.repo, revision=d.revision, repo_type="dataset", what="data file", shown=name,
                        choose=_chooser(name, d), say=lambda line: print(line, flush=True))
        _FETCHED[d] = snap.path
    return d, _FETCHED[d]


def _arrow_cache() -> str:
    """Where ``datasets`` keeps its Arrow copy: $HF_DATASETS_CACHE, else $HF_HOME/datasets (read now,
    not when ``datasets`` was imported)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "datasets")
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


def load_rows(name: str) -> list[dict]:
    """The rows of ``hub:...`` (``datasets.load_dataset`` on the cached snapshot), as dicts."""
    d, path = fetch(name)
    import datasets

    datasets.disable_progress_bars()  # "Generating train split": noise before the run's first line
    datasets.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(path, d.config, split=d.split, cache_dir=_arrow_cache())
    except ValueError as e:
        msg = str(e).replace("\n", " ")
        if "Unknown split" in msg:
            splits = re.findall(r"'([^']+)'", msg.split("Should be one of")[-1])
            raise UserError(f"data file {name}: {d.repo} has no split {d.split!r} (splits: {', '.join(splits)}). "
                            f"Name one as the last part: {SYNTAX}.") from None
        if "Config name is missing" in msg or "BuilderConfig" in msg:
            names = datasets.get_dataset_config_names(path)
            raise UserError(f"data file {name}: {d.repo} has the configs {', '.join(names)}. Name one: "
                            f"hub:{d.repo}:{names[0]}:{d.split}.") from None
        raise UserError(f"data file {name}: cannot load it ({msg[:200]}). Check the config and split.") from None
    except FileNotFoundError as e:
        raise UserError(f"data file {name}: its files are not in the snapshot {path} ({str(e).splitlines()[0][:160]})."
                        " Unset HF_HUB_OFFLINE to fetch them, or check the config and split.") from None
    return ds.to_list()
