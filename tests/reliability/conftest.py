"""Shared pieces of the reliability tests: a real RunSpec built once (no Ray), specs that differ in
a few keys, and the processes a run left behind."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def base_spec(rlhf_cache, tmp_path_factory):
    from rlhf.cli import build_spec, compose

    out = tmp_path_factory.mktemp("base") / "run"
    ov = [f"output_dir={out}", "tracking.backend=none", "tracking.console=none"]
    return build_spec(compose(ov), ov, plan=False)


@pytest.fixture(scope="session")
def tokenizer(base_spec):
    from rlhf.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(base_spec.model.path, base_spec.model))


def _ns(obj):
    if dataclasses.is_dataclass(obj):
        return SimpleNamespace(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    return SimpleNamespace(**vars(obj))


def variant(spec, **sections):
    """A copy of ``spec`` (as namespaces) with some keys changed: ``variant(s, data={"prompt_key": "q"})``."""
    top = _ns(spec)
    for name, changes in sections.items():
        sec = _ns(getattr(spec, name))
        for k, v in changes.items():
            setattr(sec, k, v)
        setattr(top, name, sec)
    return top


def marked_pids(marker: str) -> list[int]:
    """Processes (other than this one) whose environment holds ``marker`` (e.g. ``RLHF_TEST_MARK=x``):
    what a run started, found again after it ended or was killed."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes():
                out.append(int(d.name))
        except OSError:
            pass
    return out
