"""Repos of the Hugging Face Hub (models and data sets) fetched into huggingface_hub's cache, each
failure one ``UserError`` that says what to do.

    is_repo_id(s)          an ``org/name`` (or ``name``) id, as opposed to a local path
    hub_cache()            where snapshots go: $HF_HUB_CACHE, else $HF_HOME/hub (~/.cache/huggingface/hub)
    cached_snapshot(...)   a revision's snapshot dir when the cache has it (cached_commit: its commit)
    offline()              HF_HUB_OFFLINE=1: the cache only, never the network
    snapshot(...)          the cache first, without network (a branch such as main is taken at the
                           commit cached; pin model.revision or delete the snapshot to move on);
                           else, unless offline, list the repo at the revision, pick the files
                           needed, check the disk has room, download them with huggingface_hub's
                           progress bar. Returns the snapshot dir and its commit.

The token is huggingface_hub's own (HF_TOKEN, HUGGING_FACE_HUB_TOKEN or ``hf auth login``); this
module only asks whether one is set (to word an error) and never prints or passes it on. HF_ENDPOINT points at a mirror. The environment is read at each
call (not at import), so a process can change it before resolving.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from rlhf.spec.errors import UserError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
TRUE = {"1", "ON", "YES", "TRUE"}


def is_repo_id(s: str) -> bool:
    """``org/name`` or ``name`` that could be a Hub id: not absolute, not ./ or ~, one slash at most."""
    return bool(REPO_ID.fullmatch(s)) and ".." not in s and not s.endswith((".", "-"))


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) now, or when huggingface_hub was imported."""
    if os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE", "")).upper() in TRUE:
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def endpoint() -> Optional[str]:
    return os.environ.get("HF_ENDPOINT") or None


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


@dataclass(frozen=True)
class Snapshot:
    path: str  # the snapshot dir in the cache
    repo: str
    commit: str


def _url(repo: str, repo_type: str) -> str:
    base = endpoint() or "https://huggingface.co"
    return f"{base}/{'datasets/' if repo_type == 'dataset' else ''}{repo}"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _free_bytes(path: str) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _head(what: str, shown: str) -> str:
    """How an error names the value: ``model.path=org/name``, or ``data file hub:org/name:train``."""
    return f"{what} {shown}" if what == "data file" else f"{what}={shown}"


def no_room(what: str, shown: str, need: int, free: int) -> UserError:
    return UserError(
        f"{_head(what, shown)}: not enough disk space in {hub_cache()} to download it ({_size(need)} needed, "
        f"{_size(free)} free). Free space there, or set HF_HOME (or HF_HUB_CACHE) to a disk with room."
    )


def hub_error(e: BaseException, what: str, shown: str, repo: str, revision: Optional[str],
              repo_type: str = "model") -> UserError:
    """A huggingface_hub exception → one line naming the value and the fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    head = _head(what, shown)
    kind = "data set" if repo_type == "dataset" else "model"
    rev_key = "the @<revision> of the data file" if repo_type == "dataset" else \
        ("model.revision" if what == "model.path" else "reward.model_revision")
    if isinstance(e, GatedRepoError):  # a subclass of RepositoryNotFoundError: first
        token = ("the token in use has no access to it" if _has_token()
                 else "no token is set (HF_TOKEN or `hf auth login`)")
        return UserError(f"{head}: {repo} is a gated {kind} repo and {token}. Accept its terms at "
                         f"{_url(repo, repo_type)}, then set HF_TOKEN to a token of that account.")
    # a model id could also have been meant as a relative local dir: say both were looked for
    local = f"no local dir {shown!r}, and " if repo_type == "model" and shown == repo else ""
    if isinstance(e, RepositoryNotFoundError):
        private = "" if _has_token() else " (a private repo needs HF_TOKEN)"
        return UserError(f"{head}: {local}no {kind} repo {repo!r} on the Hugging Face Hub{private}. "
                         f"Check the id (org/name), or give a local dir.")
    if isinstance(e, RevisionNotFoundError):
        return UserError(f"{head}: {repo} has no revision {revision!r}. Give a branch, tag or commit of "
                         f"the repo in {rev_key}, or leave it unset for main.")
    if isinstance(e, IncompleteSnapshotError):
        return UserError(f"{head}: the cached snapshot of {repo} in {hub_cache()} is incomplete and the Hub "
                         "cannot be reached. Download it again with network access (HF_HUB_OFFLINE unset).")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"{head}: the disk filled up while downloading {repo} into {hub_cache()}. "
                         "Free space there, or set HF_HOME (or HF_HUB_CACHE) to a disk with room.")
    if isinstance(e, LocalEntryNotFoundError):
        at = f"{repo}" + (f"@{revision}" if revision else "")
        if offline():
            fetch = f"hf download {repo}" + (" --repo-type dataset" if repo_type == "dataset" else "")
            return UserError(f"{head}: {local}{at} is not in the Hugging Face cache ({hub_cache()}) and "
                             "HF_HUB_OFFLINE=1 forbids downloading it. Unset HF_HUB_OFFLINE to download it, "
                             f"or fetch it first ({fetch}), or give a local dir.")
        cause = e.__cause__ or e.__context__
        why = f" ({type(cause).__name__}: {str(cause).splitlines()[0][:120]})" if cause is not None else ""
        return UserError(f"{head}: {local}cannot reach the Hugging Face Hub at {endpoint() or 'huggingface.co'}{why} "
                         f"and {at} is not in the cache ({hub_cache()}). Check the network (or HF_ENDPOINT), "
                         "or fetch it where there is network and copy the cache.")
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return UserError(f"{head}: the Hugging Face Hub answered HTTP {status} for {repo}. "
                         "Retry later, or fetch it elsewhere and copy the cache (HF_HOME).")
    first = (str(e).splitlines() or [""])[0][:200]
    return UserError(f"{head}: cannot fetch {repo} from the Hugging Face Hub ({type(e).__name__}: {first}). "
                     "Check the id and the network, or give a local dir.")


def _raise(e: BaseException, *args, **kwargs) -> None:
    from huggingface_hub.errors import DryRunError, OfflineModeIsEnabled

    if isinstance(e, DryRunError) and e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, OfflineModeIsEnabled):  # the library was imported offline: the cache only
        from huggingface_hub.errors import LocalEntryNotFoundError

        e = LocalEntryNotFoundError(str(e))
    raise hub_error(e, *args, **kwargs) from None


def cached_snapshot(repo: str, revision: Optional[str] = None, repo_type: str = "model") -> Optional[Path]:
    """The snapshot dir of ``repo`` at ``revision`` (None: main) in the HF cache, if it is there;
    read from the cache layout alone (refs/<revision>, snapshots/<commit>), no network."""
    top = Path(hub_cache()) / f"{repo_type}s--{repo.replace('/', '--')}"
    rev = revision or "main"
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    if commit is None and (top / "refs" / rev).is_file():
        commit = (top / "refs" / rev).read_text().strip()
    return top / "snapshots" / commit if commit and (top / "snapshots" / commit).is_dir() else None


def cached_commit(repo: str, revision: Optional[str] = None, repo_type: str = "model") -> Optional[str]:
    """The commit of ``cached_snapshot`` (None when not cached)."""
    snap = cached_snapshot(repo, revision, repo_type)
    return snap.name if snap is not None else None


def _quiet_tqdm():
    from tqdm.auto import tqdm

    class Quiet(tqdm):  # the listing before a download: no bar of its own
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _cached(repo: str, rev: str, kw: dict, choose, complete) -> Optional[Snapshot]:
    """The revision's snapshot in the cache when it holds every file ``choose`` picks (as far as the
    cached file list tells) and passes ``complete``; None otherwise. No network."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        # allow_patterns=[]: the snapshot dir of the revision, without requiring every repo file
        path = snapshot_download(repo, revision=rev, local_files_only=True, allow_patterns=[], **kw)
    except LocalEntryNotFoundError:
        return None
    commit = Path(path).name
    if choose is not None:
        try:
            names = [f.path for f in get_cached_repo_tree(repo, repo_type=kw["repo_type"], revision=commit,
                                                           cache_dir=kw["cache_dir"])]
        except CachedRepoTreeNotFoundError:  # a cache filled by other means: trust its files
            names = None
        if names is not None and any(not (Path(path) / n).exists() for n in choose(names, commit)):
            return None
    if complete is not None and not complete(path):
        return None
    return Snapshot(path, repo, commit)


def snapshot(repo: str, *, revision: Optional[str] = None, repo_type: str = "model", what: str = "model.path",
             shown: Optional[str] = None, choose: Optional[Callable[[list[str], str], Iterable[str]]] = None,
             complete: Optional[Callable[[str], bool]] = None, say: Optional[Callable[[str], None]] = None) -> Snapshot:
    """``repo`` at ``revision`` (None: main): the HF cache first (no network), else a download when
    allowed. ``choose(names, commit)`` picks the repo files needed (default: all); ``complete(dir)``
    says whether a cached snapshot is usable; ``what``/``shown`` name the config key and value in
    errors; ``say`` gets one line before a download starts."""
    from huggingface_hub import snapshot_download

    shown = shown or repo
    rev = revision or "main"
    kw = dict(repo_type=repo_type, cache_dir=hub_cache(), endpoint=endpoint())
    err = (what, shown, repo, revision, repo_type)
    try:
        hit = _cached(repo, rev, kw, choose, complete)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - mapped to one line
        _raise(e, *err)
    if hit is not None:
        return hit
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if offline():
        _raise(LocalEntryNotFoundError("not cached"), *err)
    try:
        infos = snapshot_download(repo, revision=rev, dry_run=True, tqdm_class=_quiet_tqdm(), **kw)
    except DryRunError as e:  # the Hub did not answer (or refused)
        cause = e.__cause__
        if not isinstance(cause, (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError)):
            cause = LocalEntryNotFoundError("not cached")
            cause.__cause__ = e.__cause__ or e
        _raise(cause, *err)
    except Exception as e:  # noqa: BLE001
        _raise(e, *err)
    if not infos:
        raise UserError(f"{_head(what, shown)}: the repo {repo} has no files. Check the id and the revision.")
    commit = infos[0].commit_hash
    names = set(choose([i.filename for i in infos], commit)) if choose else {i.filename for i in infos}
    todo = [i for i in infos if i.filename in names and i.will_download]
    need = sum(i.file_size or 0 for i in todo)
    free = _free_bytes(hub_cache())
    if need > free:
        raise no_room(what, shown, need, free)
    if todo and say is not None:
        label = f"data file {shown}" if what == "data file" else what
        files = f"{len(todo)} file{'s' if len(todo) > 1 else ''}"
        say(f"{label}: downloading {repo}@{rev} ({_size(need)}, {files}) into {hub_cache()}")
    try:
        path = snapshot_download(repo, revision=commit, allow_patterns=sorted(names),
                                 **({} if todo else {"tqdm_class": _quiet_tqdm()}), **kw)
    except Exception as e:  # noqa: BLE001
        _raise(e, *err)
    return Snapshot(path, repo, commit)
