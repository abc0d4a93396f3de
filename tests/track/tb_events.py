"""Read TensorBoard event files without TensorBoard: the TFRecord framing and tensorboardX's protos.

A record is ``length (uint64 LE) | crc32c(length) (4) | data | crc32c(data) (4)``; each ``data`` is
an ``Event`` protobuf (the first holds only ``file_version``). CRCs are not checked.
"""

from __future__ import annotations

import struct
from pathlib import Path


def events(logdir: str | Path) -> list:
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            body = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            e = event_pb2.Event()
            e.ParseFromString(body)
            out.append(e)
    return out


def scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] in the order written."""
    out: dict[str, list[tuple[int, float]]] = {}
    for e in events(logdir):
        for v in e.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def texts(logdir: str | Path) -> dict[str, str]:
    """tag -> the text summary's string (tensorboardX writes text as a string tensor)."""
    out = {}
    for e in events(logdir):
        for v in e.summary.value:
            if v.HasField("tensor") and v.tensor.string_val:
                out[v.tag.split("/")[0]] = b"".join(v.tensor.string_val).decode()
    return out
