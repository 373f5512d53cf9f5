"""Deep health check: one 1-token generation through the ensemble. Exit status 0 when it succeeds.

tritonserver 2.51 keeps answering 200 on /v2/health/live and /v2/health/ready after a model process died (it
never restarts one), while every generation fails. A liveness probe must therefore generate, e.g. as a
Kubernetes exec probe: `python -m specdec_client.health --url 127.0.0.1:8000 --timeout-s 10`.
"""

from __future__ import annotations

import argparse
import sys

import requests

PROBE = {"text_input": "a", "max_tokens": 1, "num_draft_tokens": 0}


def check(url: str, timeout_s: float) -> str | None:
    """None when a generation succeeds, else what went wrong."""
    try:
        resp = requests.post(f"http://{url}/v2/models/ensemble/generate", json=PROBE, timeout=timeout_s)
    except requests.RequestException as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    if resp.status_code != 200 or "error" in body:
        return f"HTTP {resp.status_code}: {body.get('error', body)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8000", help="HTTP host:port of the server")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    problem = check(args.url, args.timeout_s)
    print("ok" if problem is None else f"unhealthy: {problem}")
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
