"""Steady chat traffic for the observability example, so the dashboard has something to show.

``python load.py [--url URL] [--concurrency C] [--requests N] [--pause S] [--api-key KEY]``

Waits until ``URL/ready`` answers 200, reads the model id from ``/v1/models``, then C workers send chat
completions (prompts from a small list, greedy or sampled, 16 to 64 tokens) until N requests are done
(N = 0: forever), pausing S seconds between a worker's requests. One line per request on stdout (its
tokens and ``usage.spec`` acceptance); a failed request is reported on stderr and counts as done, so a
finite run exits 1 if any failed. Standard library only: it runs in the nextn image (docker-compose.yml's
``load`` service) or anywhere with Python 3.10+.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

PROMPTS = (
    "What is a list in Python?",
    "Explain the for statement.",
    "Answer in JSON: name and age of a user called Alice who is 31.",
    "Hello! Who are you?",
    "How do I open a file for reading?",
    "What does the with statement do?",
)


def _request(url: str, api_key: str | None, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, timeout: float) -> None:
    """Until ``base/ready`` answers 200 (the model loads first); RuntimeError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}/ready did not answer 200 within {timeout:.0f} s")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="nextn base URL")
    ap.add_argument("--concurrency", type=int, default=2, help="concurrent workers")
    ap.add_argument("--requests", type=int, default=0, help="requests in all (0 = run forever)")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between one worker's requests")
    ap.add_argument("--api-key", default=None, help="bearer token, if the server has --api-key")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for /ready")
    args = ap.parse_args(argv)
    base = args.url.rstrip("/")

    wait_ready(base, args.ready_timeout)
    model = _request(base + "/v1/models", args.api_key)["data"][0]["id"]
    counter = itertools.count()
    failures: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            i = next(counter)
            if args.requests and i >= args.requests:
                return
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": 16 + 16 * (i % 4), "temperature": 0.0 if i % 3 else 0.8, "seed": i}
            try:
                r = _request(base + "/v1/chat/completions", args.api_key, body)
                spec = r["usage"].get("spec") or {}
                line = (f"request {i}: {r['usage']['completion_tokens']} tokens, "
                        f"acceptance {spec.get('acceptance_rate', 0.0):.2f} "
                        f"({spec.get('accepted', 0)}/{spec.get('drafted', 0)} drafts)")
                with lock:
                    print(line, flush=True)
            except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
                detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else ""
                with lock:
                    failures.append(f"request {i}: {e} {detail}".strip())
                    print(failures[-1], file=sys.stderr, flush=True)
            time.sleep(args.pause)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
