"""Read an offline W&B run's transaction log (``run-<id>.wandb``) without the W&B service.

The file is ``:W&B`` + a little-endian uint16 magic + a version byte, then 32 KiB blocks of
records, each ``crc32 (4) | length (uint16 LE) | type (1: whole, 2: first, 3: middle, 4: last)``
followed by its bytes; a block's tail shorter than a header is zero padding. Each whole record is
a ``wandb_internal_pb2.Record`` protobuf. (The CRC is not checked: these are test reads of a file
the same machine just wrote.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding up to the next block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        parts = body if kind in (1, 2) else parts + body
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(parts)
            out.append(r)
    return out


def closed(path: str | Path, timeout_s: float = 20.0) -> str:
    """``path`` once its exit record is on disk: W&B's service finishes writing the log a moment
    after ``run.finish()`` returns."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.1)
    return str(path)


def history(path: str | Path) -> list[dict]:
    """One dict per logged step: ``{"_step": n, key: value, ...}``."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def run_record(path: str | Path):
    """The run record (project, group, name, config) — its last version."""
    runs = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return runs[-1]


def config(path: str | Path) -> dict:
    """The config as logged: the run record's, updated by later config records."""
    cfg = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else ()
        for i in items:
            cfg[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return cfg
