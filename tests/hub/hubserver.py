"""A local stand-in for the Hugging Face Hub (``HF_ENDPOINT=http://127.0.0.1:PORT``) and a builder
of the HF cache layout, for tests without network.

The server answers the routes ``huggingface_hub.snapshot_download`` / ``hf_hub_download`` use
(read from huggingface_hub 1.x's source):

    GET  /api/{models|datasets}/{repo}/revision/{rev}     repo info: {"id", "sha"}
    GET  /api/{models|datasets}/{repo}/tree/{rev}          the file list (recursive), one page
    HEAD /[datasets/]{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length
    GET  /[datasets/]{repo}/resolve/{rev}/{file}           the bytes

and the Hub's error headers (``X-Error-Code``: RepoNotFound, RevisionNotFound, GatedRepo,
EntryNotFound) that huggingface_hub turns into its exception types.

Uploads (``HfApi.create_repo`` / ``create_commit`` / ``upload_folder``), every file sent inline:

    POST /api/repos/create                                 {"name", "organization"}: 200, or 409 if it exists
    POST /api/validate-yaml                                a README's metadata: always valid
    POST /api/models/{repo}/preupload/{rev}                every file "regular" (base64 in the commit)
    POST /api/models/{repo}/commit/{rev}                   the ndjson commit: files added, a new commit id

With ``token`` set, uploads need ``Authorization: Bearer <token>`` (else 401); ``refuse_commits``
answers every commit with a 500 (a Hub failing mid-push). A gated repo answers file
requests only with ``Authorization: Bearer <token>``. ``sizes`` makes a file claim another size
(a huge model, for the disk-space check) without serving it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    sizes: dict[str, int] = field(default_factory=dict)  # claimed sizes (not served)
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            h = hashlib.sha1()
            for name in sorted(self.files):
                h.update(name.encode() + b"\0" + self.files[name])
            self.commit = h.hexdigest()

    def etag(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()

    def size(self, name: str) -> int:
        return self.sizes.get(name, len(self.files[name]))


class HubServer:
    """``with HubServer({("model", "org/name"): Repo(...)}, token="hf_x") as url: ...``"""

    def __init__(self, repos: dict[tuple[str, str], Repo], token: Optional[str] = None,
                 refuse_commits: bool = False):
        self.repos = repos
        self.token = token
        self.refuse_commits = refuse_commits
        self.commits: list[tuple[str, str]] = []  # (repo id, commit message)
        self.requests: list[tuple[str, str, bool]] = []  # (method, path, had an Authorization header)
        self._httpd: Optional[ThreadingHTTPServer] = None

    def __enter__(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server._handle(self, body=False)

            def do_GET(self):
                server._handle(self, body=True)

            def do_POST(self):
                server._upload(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()

    # ------------------------------------------------------------------ routing

    def _find(self, kind: str, rest: str) -> tuple[Optional[str], str]:
        """(repo id, what follows it) for the longest known repo id that starts ``rest``."""
        for repo in sorted((r for k, r in self.repos if k == kind), key=len, reverse=True):
            if rest == repo or rest.startswith(repo + "/"):
                return repo, rest[len(repo) + 1:]
        parts = rest.split("/")
        return None, "/".join(parts[2:])

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, "authorization" in {k.lower() for k in h.headers}))
        m = re.fullmatch(r"/api/(models|datasets)/(.+)", path)
        if m:
            kind = m.group(1)[:-1]
            repo, rest = self._find(kind, m.group(2))
            if repo is None:
                return self._error(h, 401, "RepoNotFound", "Repository not found")
            r = self.repos[(kind, repo)]
            op, _, tail = rest.partition("/")
            rev, _, _ = tail.partition("/")
            if rev not in ("main", r.commit):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            if op == "revision":
                return self._json(h, {"id": repo, "sha": r.commit, "private": False,
                                      "gated": "auto" if r.gated else False,
                                      "siblings": [{"rfilename": n} for n in sorted(r.files)]})
            if op == "tree":
                return self._json(h, [{"type": "file", "path": n, "size": r.size(n), "oid": r.etag(n)}
                                      for n in sorted(r.files)])
            return self._error(h, 404, None, "no such route")
        kind = "dataset" if path.startswith("/datasets/") else "model"
        repo, rest = self._find(kind, path[len("/datasets/"):] if kind == "dataset" else path[1:])
        m = re.fullmatch(r"resolve/([^/]+)/(.+)", rest)
        if repo is None or m is None:
            return self._error(h, 401, "RepoNotFound", "Repository not found")
        r = self.repos[(kind, repo)]
        rev, name = m.groups()
        if rev not in ("main", r.commit):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if r.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, "GatedRepo", "Access to this model is restricted")
        if name not in r.files:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist")
        data = r.files[name]
        h.send_response(200)
        h.send_header("X-Repo-Commit", r.commit)
        h.send_header("ETag", f'"{r.etag(name)}"')
        h.send_header("Content-Length", str(r.size(name) if not body else len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _upload(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(h.path).path)
        data = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        self.requests.append((h.command, path, "authorization" in {k.lower() for k in h.headers}))
        if path == "/api/validate-yaml":
            return self._json(h, {"errors": [], "warnings": []})
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, None, "Invalid credentials in Authorization header")
        if path == "/api/repos/create":
            body = json.loads(data)
            repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            kind = body.get("type") or "model"
            if (kind, repo) in self.repos:
                return self._error(h, 409, None, "You already created this model repo")
            self.repos[(kind, repo)] = Repo(files={})
            return self._json(h, {"url": f"http://{h.headers['Host']}/{repo}", "name": repo})
        m = re.fullmatch(r"/api/(models|datasets)/(.+)/(preupload|commit)/([^/]+)", path)
        if m is None:
            return self._error(h, 404, None, "no such route")
        kind, repo, op, _rev = m.group(1)[:-1], m.group(2), m.group(3), m.group(4)
        if (kind, repo) not in self.repos:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        r = self.repos[(kind, repo)]
        if op == "preupload":
            files = json.loads(data)["files"]
            return self._json(h, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                             "oid": None} for f in files]})
        if self.refuse_commits:
            return self._error(h, 500, None, "Internal Error - We're working hard to fix this as soon as possible!")
        import base64

        message = ""
        for line in data.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                message = item["value"]["summary"]
            elif item["key"] == "file":
                r.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        h_ = hashlib.sha1()
        for name in sorted(r.files):
            h_.update(name.encode() + b"\0" + r.files[name])
        r.commit = h_.hexdigest()
        self.commits.append((repo, message))
        return self._json(h, {"commitUrl": f"http://{h.headers['Host']}/{repo}/commit/{r.commit}",
                              "commitOid": r.commit, "pullRequestUrl": None})

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: Optional[str], message: str) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


def write_cache(hub_cache: Path, kind: str, repo_id: str, repo: Repo) -> Path:
    """Write ``repo`` into an HF hub cache as huggingface_hub lays it out: blobs/<etag>,
    snapshots/<commit>/<file> (a relative symlink to the blob), refs/main. Returns the snapshot dir."""
    top = Path(hub_cache) / f"{kind}s--{repo_id.replace('/', '--')}"
    snap = top / "snapshots" / repo.commit
    for name, data in repo.files.items():
        blob = top / "blobs" / repo.etag(name)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (top / "refs").mkdir(parents=True, exist_ok=True)
    (top / "refs" / "main").write_text(repo.commit)
    return snap
