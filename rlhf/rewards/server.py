"""`rlhf-reward-server`: serve a Python reward function or a reward model over HTTP.

    rlhf-reward-server --fn my_rewards:exact_match --port 8000
    rlhf-reward-server --model outputs/rm/final/hf --port 8001

Binds 127.0.0.1 unless ``--host`` says otherwise. Speaks the protocol in ``rlhf.rewards.remote``.
The standard library's threading HTTP server is enough: scoring is batched, so requests are few.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

ScoreFn = Callable[..., list]


def model_scorer(path: str, device: str = "cpu", batch_size: int = 32) -> ScoreFn:
    """Score (prompt, response) pairs with a sequence-classification reward model (one label)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).to(device).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    lock = threading.Lock()  # one forward at a time: the model is not re-entrant on every backend

    def score(prompts: list[str], responses: list[str], **_: object) -> list[float]:
        out: list[float] = []
        with lock, torch.no_grad():
            for i in range(0, len(prompts), batch_size):
                texts = [p + r for p, r in zip(prompts[i:i + batch_size], responses[i:i + batch_size])]
                enc = tok(texts, return_tensors="pt", padding=True).to(device)
                out.extend(model(**enc).logits[:, 0].float().tolist())
        return out

    return score


class RewardServer:
    """A running server; ``url`` is where it listens. ``close()`` stops it."""

    def __init__(self, score: ScoreFn, host: str = "127.0.0.1", port: int = 0):
        handler = _handler(score)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "RewardServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(score: ScoreFn):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/score":
                self._send(404, {"error": f"no route {self.path}"})
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompts, responses = req["prompts"], req["responses"]
                meta = req.get("metadata") or {}
                if len(prompts) != len(responses):
                    raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
            except (ValueError, KeyError, TypeError) as e:
                self._send(400, {"error": f"bad request: {e}"})
                return
            try:
                rewards = [float(r) for r in score(prompts, responses, **meta)]
            except Exception as e:  # the user's function failed: report it, keep serving
                self._send(500, {"error": f"{type(e).__name__}: {e}"})
                return
            if len(rewards) != len(responses) or not all(math.isfinite(r) for r in rewards):
                self._send(500, {"error": "the reward function returned a wrong count or non-finite values"})
                return
            self._send(200, {"rewards": rewards})

        def log_message(self, fmt: str, *args: object) -> None:  # quiet: one line per request is noise
            pass

    return Handler


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="rlhf-reward-server", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--fn", help="module:function or path/to/file.py:function")
    src.add_argument("--model", help="a reward model directory (HF, one-label sequence classification)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    from rlhf.spec.errors import UserError

    try:
        if args.fn:
            from rlhf.rewards.loader import load_function

            score = load_function(args.fn)
        else:
            score = model_scorer(args.model, device=args.device)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = RewardServer(score, host=args.host, port=args.port)
    print(f"serving rewards at {server.url} (POST /score, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


def entrypoint() -> None:
    sys.exit(main())
