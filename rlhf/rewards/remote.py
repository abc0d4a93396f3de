"""A client for reward services over HTTP: batched, concurrent, retried, load-balanced.

Protocol (served by ``rlhf.rewards.server``; any service that speaks it works):

    POST <url>/score   {"prompts": [...], "responses": [...], "metadata": {key: [...]}}
                   →   {"rewards": [float, ...]}            one per response, same order
    GET  <url>/health  → 200 {"status": "ok"}

Requests go out in batches of ``batch_size`` with at most ``concurrency`` in flight, spread over the
URLs round-robin; a failed request (connection error, timeout, HTTP 5xx) is retried on the next URL
with exponential backoff, and after ``retries`` attempts the error names the URLs and the cause.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from rlhf.spec.errors import UserError


class RemoteRewardError(UserError):
    pass


class RemoteReward:
    def __init__(
        self,
        urls: Sequence[str],
        batch_size: int = 64,
        concurrency: int = 4,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ):
        if not urls:
            raise RemoteRewardError("reward.remote.urls is empty: give at least one http://host:port of a reward server.")
        self.urls = [u.rstrip("/") for u in urls]
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._next = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()

    def _pick(self) -> int:
        with self._lock:
            return next(self._next)

    def _post(self, url: str, payload: dict) -> list[float]:
        req = urllib.request.Request(
            url + "/score", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            body = json.loads(resp.read())
        rewards = body.get("rewards") if isinstance(body, dict) else None
        if not isinstance(rewards, list):
            raise ValueError(f"answer has no 'rewards' list: {str(body)[:200]}")
        return [float(r) for r in rewards]

    def _score_batch(self, payload: dict, n: int) -> list[float]:
        first = self._pick()
        last_error: Optional[BaseException] = None
        for attempt in range(self.retries + 1):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                rewards = self._post(url, payload)
            except urllib.error.HTTPError as e:
                if e.code < 500:  # the request itself is wrong: retrying cannot help
                    raise RemoteRewardError(f"reward server {url} rejected the request: HTTP {e.code} {e.reason}") from None
                last_error = e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, ValueError) as e:
                last_error = e
            else:
                if len(rewards) != n:
                    raise RemoteRewardError(f"reward server {url} returned {len(rewards)} rewards for {n} responses.")
                bad = [r for r in rewards if not math.isfinite(r)]
                if bad:
                    raise RemoteRewardError(f"reward server {url} returned non-finite rewards ({bad[:3]}).")
                return rewards
            if attempt < self.retries:
                time.sleep(self.backoff_s * (2**attempt))
        raise RemoteRewardError(
            f"reward servers {', '.join(self.urls)} did not answer after {self.retries + 1} attempts "
            f"(last error: {last_error}). Start one with `rlhf-reward-server` or fix reward.remote.urls."
        )

    def __call__(self, prompts: list[str], responses: list[str], **metadata: Any) -> list[float]:
        n = len(responses)
        chunks = [(i, min(i + self.batch_size, n)) for i in range(0, n, self.batch_size)]

        def payload(lo: int, hi: int) -> dict:
            meta = {k: list(v[lo:hi]) for k, v in metadata.items() if isinstance(v, (list, tuple))}
            return {"prompts": list(prompts[lo:hi]), "responses": list(responses[lo:hi]), "metadata": meta}

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            parts = list(pool.map(lambda c: self._score_batch(payload(*c), c[1] - c[0]), chunks))
        return [r for part in parts for r in part]

    def healthy(self) -> list[str]:
        """The URLs that answer /health."""
        ok = []
        for url in self.urls:
            try:
                with urllib.request.urlopen(url + "/health", timeout=min(self.timeout_s, 5)) as resp:
                    if resp.status == 200:
                        ok.append(url)
            except (urllib.error.URLError, OSError):
                pass
        return ok
