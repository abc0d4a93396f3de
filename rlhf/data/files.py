"""Local data files → lists of records (dicts), with errors a user can act on.

Formats, chosen by the path:

    *.jsonl / *.jsonl.gz     one JSON object per line
    *.json                   a list of objects, or {"data": [...]}, or {column: [values...]}
    *.parquet                (pyarrow)
    *.csv / *.tsv            header row, every value a string
    a directory              an HF ``datasets`` dataset written by ``save_to_disk`` (read offline);
                             a DatasetDict takes the ``train`` split unless ``dir::split`` names one
    builtin:<task>/<split>   the built-in task's files (generated on first use): keymap/train|eval;
                             agent-<task>/<split> (rlhf.data.agent_tasks)
                             (RL prompts), keymap-sft/..., keymap-preference/..., keymap-prompts/...
    hub:<org>/<name>[@<revision>][:<config>]:<split>
                             a Hugging Face Hub data set (rlhf.data.hub), fetched into the HF cache

``columns`` (``data.columns``: ["old:new", ...]) renames columns in every row of every file.

Every problem becomes one ``UserError`` that names the file, the row and the fix, e.g.

    data file data/prefs.jsonl, row 17: no key 'chosen' (keys: prompt, better, worse).
    Set data.chosen_key=<the key that holds the preferred response>.

Several training files are mixed by ``mix`` with ``data.weights``: the weights are the shares of
each file in the mixed set, which has as many rows as the files together (a file whose share is
larger than its size is repeated; a smaller one is subsampled).
"""

from __future__ import annotations

import csv
import functools
import gzip
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from rlhf.spec.errors import UserError

BUILTIN_PREFIX = "builtin:"
HUB_PREFIX = "hub:"
EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".csv", ".tsv")

# key in DataSpec → what the value holds (for the "Set data.<x>_key=..." hint)
KEY_MEANING = {
    "prompt_key": "the prompt",
    "response_key": "the response to train on",
    "chosen_key": "the preferred response",
    "rejected_key": "the dispreferred response",
    "messages_key": "the conversation (a list of {role, content})",
}


@dataclass
class Records:
    """The rows of one file (or a mix), and where they came from (for error messages)."""

    rows: list[dict[str, Any]]
    source: str  # a display name: the path, or "a + b" for a mix
    origins: Optional[list[tuple[str, int]]] = None  # per row: (file, row index in that file)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        if self.origins is not None:
            f, r = self.origins[i]
            return f"data file {f}, row {r}"
        return f"data file {self.source}, row {i}"


# ----------------------------------------------------------------------------- loading


def resolve_builtin(name: str) -> str:
    """``builtin:<task>/<split>`` → a local file, generated on first use by rlhf.data.builtin."""
    try:
        from rlhf.data import builtin
    except ImportError as e:  # pragma: no cover - the module ships with the package
        raise UserError(f"{BUILTIN_PREFIX}{name}: the built-in task module is not available ({e}).") from None
    if name.startswith("agent-"):  # the agent tasks (rlhf.data.agent_tasks)
        from rlhf.data.agent_tasks import data_file

        return str(data_file(name))
    if name.startswith("keymap-"):  # synthetic SFT / preference / prompt sets (rlhf.data.make)
        from rlhf.data.make import builtin_file

        return str(builtin_file(name))
    return str(builtin.data_file(name))


def load_file(path: str, columns: Optional[Sequence[str]] = None) -> Records:
    """One file (or saved dataset directory, or Hub data set) → Records. Raises UserError."""
    spec = str(path)
    if spec.startswith(BUILTIN_PREFIX):
        real = resolve_builtin(spec[len(BUILTIN_PREFIX):])
        rec = load_file(real, columns)
        rec.source = spec if real == spec else f"{spec} ({real})"
        return rec
    if spec.startswith(HUB_PREFIX):
        from rlhf.data.hub import load_rows

        return _records(load_rows(spec), spec, columns)
    split = None
    if "::" in spec:
        spec, split = spec.rsplit("::", 1)
    p = Path(os.path.expanduser(spec))
    if not p.exists():
        hint = ""
        parent = p.parent if str(p.parent) else Path(".")
        if parent.is_dir():
            near = sorted(x.name for x in parent.iterdir() if x.name.endswith(EXTENSIONS) or x.is_dir())[:8]
            if near:
                hint = f" Files in {parent}: {', '.join(near)}."
        raise UserError(f"data file {spec} does not exist.{hint} Check data.train_files / data.eval_files.")
    if p.is_dir():
        rows = _load_saved_dataset(p, split)
    else:
        rows = _load_by_name(p, spec)
    return _records(rows, spec, columns)


def _records(rows: list[Any], spec: str, columns: Optional[Sequence[str]]) -> Records:
    if not rows:
        raise UserError(f"data file {spec} is empty (no rows). Check the file, or remove it from data.train_files.")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise UserError(
                f"data file {spec}, row {i}: expected an object with named fields, got {type(r).__name__} "
                f"({_short(r)}). Write one JSON object per row, e.g. {{\"prompt\": ..., \"response\": ...}}."
            )
    return Records(rows=rename_columns(rows, columns, spec) if columns else rows, source=spec)


def rename_columns(rows: list[dict[str, Any]], columns: Sequence[str], source: str) -> list[dict[str, Any]]:
    """Rows with ``old`` keys renamed to ``new`` (``data.columns``: "old:new" each); a row holding
    both is an error."""
    pairs = [tuple(c.split(":", 1)) for c in columns]
    out = []
    for i, row in enumerate(rows):
        row = dict(row)
        for old, new in pairs:
            if old in row and old != new:
                if new in row:
                    raise UserError(
                        f"data file {source}, row {i}: data.columns renames {old!r} to {new!r}, but the row has both. "
                        f"Drop {old}:{new} from data.columns, or point the key (e.g. data.prompt_key) at one of them."
                    )
                row[new] = row.pop(old)
        out.append(row)
    return out


def _load_by_name(p: Path, spec: str) -> list[Any]:
    try:
        name = p.name.lower()
        if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
            rows = _load_jsonl(p)
        elif name.endswith(".json"):
            rows = _load_json(p)
        elif name.endswith(".parquet"):
            rows = _load_parquet(p)
        elif name.endswith(".csv") or name.endswith(".tsv"):
            rows = _load_csv(p, delimiter="\t" if name.endswith(".tsv") else ",")
        else:
            raise UserError(
                f"data file {spec}: unknown format. Use one of {', '.join(EXTENSIONS)}, "
                "or a directory written by datasets' save_to_disk."
            )
    except UnicodeDecodeError as e:
        raise _not_utf8(p, e) from None
    except (OSError, EOFError) as e:  # unreadable, or a truncated .gz
        raise UserError(f"data file {spec}: cannot read it ({type(e).__name__}: {e}).".replace("\n", " ")) from None
    return rows


def _not_utf8(p: Path, e: UnicodeDecodeError, where: str = "") -> UserError:
    return UserError(
        f"data file {p}{where}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}). "
        "Save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
    )


def _load_jsonl(p: Path) -> list[Any]:
    opener: Callable[..., Any] = gzip.open if p.name.lower().endswith(".gz") else open
    rows = []
    with opener(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(p, e, f", line {lineno}") from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(
                    f"data file {p}, line {lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                    "Each line of a .jsonl file must be one JSON object."
                ) from None
    return rows


def _load_json(p: Path) -> list[Any]:
    try:
        with open(p, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        hint = " (is it JSON lines? name it .jsonl)" if e.msg == "Extra data" else ""
        raise UserError(f"data file {p}: not valid JSON ({e.msg}, line {e.lineno}){hint}.") from None
    if isinstance(obj, dict):
        if isinstance(obj.get("data"), list):
            return obj["data"]
        cols = [v for v in obj.values()]
        if cols and all(isinstance(v, list) for v in cols):
            n = {len(v) for v in cols}
            if len(n) != 1:
                raise UserError(f"data file {p}: the columns have different lengths ({sorted(n)}).")
            keys = list(obj)
            return [dict(zip(keys, vals)) for vals in zip(*cols)]
        raise UserError(
            f"data file {p}: expected a list of objects, {{\"data\": [...]}} or {{column: [values]}}; "
            f"got an object with keys {', '.join(map(str, obj))}."
        )
    if isinstance(obj, list):
        return obj
    raise UserError(f"data file {p}: expected a list of objects, got {type(obj).__name__}.")


def _load_parquet(p: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise UserError(f"data file {p}: reading parquet needs pyarrow (pip install pyarrow).") from None
    try:
        return pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow raises several types for bad files
        raise UserError(f"data file {p}: cannot read as parquet ({e}).") from None


def _load_csv(p: Path, delimiter: str) -> list[dict[str, Any]]:
    with open(p, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if not reader.fieldnames:
            return []
        return [dict(r) for r in reader]


def _load_saved_dataset(p: Path, split: Optional[str]) -> list[dict[str, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if not any((p / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise UserError(
            f"data file {p} is a directory but not a dataset written by datasets' save_to_disk "
            "(no dataset_info.json / dataset_dict.json). Give a .jsonl/.json/.parquet/.csv file instead."
        )
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise UserError(f"data file {p}: cannot load the saved dataset ({e}).") from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        want = split or ("train" if "train" in ds else names[0] if len(names) == 1 else None)
        if want not in ds:
            raise UserError(
                f"data file {p} holds the splits {', '.join(names)}; name one as {p}::<split>, e.g. {p}::{names[0]}."
            )
        ds = ds[want]
    elif split:
        raise UserError(f"data file {p} is a single dataset without splits: drop '::{split}'.")
    return ds.to_list()


def load_files(paths: Sequence[str], weights: Optional[Sequence[float]] = None, *, seed: int = 0,
               columns: Optional[Sequence[str]] = None) -> Records:
    """Load and mix several files (see ``mix``); one file is returned as it is."""
    if not paths:
        raise UserError("no data files given. Set data.train_files=[path/to/train.jsonl].")
    parts = [load_file(p, columns) for p in paths]
    if len(parts) == 1 and weights is None:
        return parts[0]
    return mix(parts, weights, seed=seed)


def mix(parts: Sequence[Records], weights: Optional[Sequence[float]], *, seed: int = 0) -> Records:
    """Mix files by weight: file i gets ``round(N * w_i / sum(w))`` of the ``N = sum(len)`` rows.

    A file asked for more rows than it has is repeated whole as often as fits and the remainder is
    sampled without replacement; rows are shuffled together with ``seed``.
    """
    if weights is None:
        weights = [1.0 * len(p) for p in parts]  # plain concatenation
    if len(weights) != len(parts):
        raise UserError(f"data.weights has {len(weights)} entries for {len(parts)} files: give one per file.")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"data.weights={list(weights)}: weights must be >= 0 and not all 0.")
    total_rows = sum(len(p) for p in parts)
    total_w = float(sum(weights))
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    origins: list[tuple[str, int]] = []
    for part, w in zip(parts, weights):
        want = int(round(total_rows * w / total_w))
        idx: list[int] = []
        full, rest = divmod(want, len(part))
        for _ in range(full):
            idx.extend(range(len(part)))
        idx.extend(rng.sample(range(len(part)), rest))
        rows.extend(part.rows[i] for i in idx)
        origins.extend((part.source, i) for i in idx)
    order = list(range(len(rows)))
    rng.shuffle(order)
    return Records(
        rows=[rows[i] for i in order],
        source=" + ".join(p.source for p in parts),
        origins=[origins[i] for i in order],
    )


def split_eval(rec: Records, fraction: float, *, seed: int = 0) -> tuple[Records, Records]:
    """Hold out ``fraction`` of the rows (at least one, when fraction > 0) for evaluation."""
    n = len(rec)
    n_eval = 0 if fraction <= 0 else max(1, int(round(n * fraction)))
    if n_eval >= n:
        raise UserError(
            f"{rec.source} has {n} rows: too few to hold out algo.eval_fraction={fraction} for evaluation. "
            "Add rows, lower algo.eval_fraction, or give data.eval_files."
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    ev, tr = sorted(order[:n_eval]), sorted(order[n_eval:])
    return _subset(rec, tr), _subset(rec, ev)


def _subset(rec: Records, idx: Iterable[int]) -> Records:
    idx = list(idx)
    origins = [rec.origins[i] for i in idx] if rec.origins is not None else [(rec.source, i) for i in idx]
    return Records(rows=[rec.rows[i] for i in idx], source=rec.source, origins=origins)


# ----------------------------------------------------------------------------- counting rows


def count_rows(path: str) -> Optional[int]:
    """At most the rows ``load_file(path)`` gives, found without building them: a .jsonl(.gz)
    file's non-empty lines, a parquet file's metadata, a csv/tsv file's records, a .json file
    parsed; a built-in set's file (made on first use, as the run would). None where that is not
    cheap or not local (a Hub data set, a saved ``datasets`` directory) or the file cannot be read
    (the run's own reading then names the problem)."""
    spec = str(path)
    if spec.startswith(HUB_PREFIX) or "::" in spec:
        return None
    try:
        if spec.startswith(BUILTIN_PREFIX):
            spec = resolve_builtin(spec[len(BUILTIN_PREFIX):])
        p = Path(os.path.expanduser(spec)).resolve()
        st = p.stat()
    except (UserError, OSError):
        return None
    if not p.is_file():
        return None
    return _count_file(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _count_file(path: str, size: int, mtime_ns: int) -> Optional[int]:
    """``count_rows`` of a local file, remembered while its size and mtime stay (the plan's
    advice plans the same spec many times)."""
    p = Path(path)
    name = p.name.lower()
    try:
        if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
            opener: Callable[..., Any] = gzip.open if name.endswith(".gz") else open
            with opener(p, "rb") as f:  # bytes' strip() keeps Unicode-only whitespace: counts more, never fewer
                return sum(1 for raw in f if raw.strip())
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return int(pq.read_metadata(p).num_rows)
        if name.endswith(".csv") or name.endswith(".tsv"):
            with open(p, encoding="utf-8", newline="") as f:  # csv.DictReader skips empty records too
                return max(0, sum(1 for rec in csv.reader(f, delimiter="\t" if name.endswith(".tsv") else ",")
                                  if rec) - 1)
        if name.endswith(".json"):
            return len(_load_json(p))
    except Exception:  # unreadable, not the format its name says, no pyarrow: the run's reading says which
        return None
    return None


def rows_bound(paths: Sequence[str], weights: Optional[Sequence[float]] = None) -> Optional[int]:
    """At most the rows ``load_files(paths, weights)`` gives (None when a file is not counted):
    their sum; ``mix`` rounds each file's share of that sum, half a row more per file at most."""
    counts = [count_rows(p) for p in paths]
    if not counts or any(n is None for n in counts):
        return None
    total = sum(n for n in counts if n is not None)
    return total + (len(paths) // 2 if weights is not None and len(paths) > 1 else 0)


# ----------------------------------------------------------------------------- checking rows


def row_value(rec: Records, i: int, key: str, *, spec_key: str, kinds: tuple[str, ...] = ("text",)) -> Any:
    """``rec.rows[i][key]`` checked to be one of ``kinds``: "text" (a string, possibly empty) or
    "messages" (a non-empty list of {role, content}). Raises UserError naming file, row and fix."""
    row = rec.rows[i]
    if key not in row:
        keys = ", ".join(map(str, row)) or "none"
        meaning = KEY_MEANING.get(spec_key, "this field")
        raise UserError(
            f"{rec.where(i)}: no key {key!r} (keys: {keys}). "
            f"Set data.{spec_key}=<the key that holds {meaning}>."
        )
    value = row[key]
    if "text" in kinds and isinstance(value, str):  # may be empty: an empty response is a response
        return value
    if "messages" in kinds and isinstance(value, list):
        check_messages(value, where=f"{rec.where(i)}: {key!r}")
        return value
    want = " or ".join({"text": "a string", "messages": "a list of {role, content} messages"}[k] for k in kinds)
    raise UserError(
        f"{rec.where(i)}: {key!r} should be {want}, got {type(value).__name__} ({_short(value)}). "
        f"Fix the row, or point data.{spec_key} at the right key."
    )


def check_messages(msgs: Any, *, where: str) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where} should be a non-empty list of {{role, content}} messages, got {_short(msgs)}.")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(
                f"{where}, message {j}: expected {{\"role\": ..., \"content\": ...}}, got {_short(m)}."
            )
        if not isinstance(m["content"], str):
            raise UserError(f"{where}, message {j}: content should be a string, got {type(m['content']).__name__}.")


def _short(v: Any, n: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
