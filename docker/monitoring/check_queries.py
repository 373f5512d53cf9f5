"""Evaluate every query of the Grafana dashboard on a real Prometheus: each must parse, and (GPU panels
aside) return series once the server has had traffic.

Against a running stack (e.g. docker/monitoring/docker-compose.yml):

    python docker/monitoring/check_queries.py --prometheus http://127.0.0.1:9090

`local_prometheus()` starts a throwaway Prometheus (the Debian `prometheus` binary) scraping one Triton
metrics endpoint; tests/integration/test_metrics.py uses it against the suite's server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "dashboards" / "specdec-triton.json"
# Grafana's variables, as a query of the whole range with every server and task selected would see them.
VARIABLES = {"$server": ".*", "$task": ".*", "$__rate_interval": "{rate}", "$__range": "{range}"}
GPU_ONLY = ("nv_gpu_",)


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def substitute(expr: str, rate: str, range_: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value.format(rate=rate, range=range_))
    return expr


def evaluate(prometheus: str, expr: str) -> tuple[str, int, str]:
    """(status, number of series, error) of an instant query."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 400 for a query that does not parse
        body = json.loads(exc.read())
    return body["status"], len(body.get("data", {}).get("result", [])), body.get("error", "")


def check(prometheus: str, rate: str = "1m", range_: str = "5m") -> list[dict]:
    """One row per dashboard query: panel, expression, status, series, and whether it may be empty."""
    dashboard = json.loads(DASHBOARD.read_text())
    rows = []
    for title, expr in dashboard_queries(dashboard):
        status, series, error = evaluate(prometheus, substitute(expr, rate, range_))
        rows.append({"panel": title, "expr": expr, "status": status, "series": series, "error": error,
                     "may_be_empty": any(prefix in expr for prefix in GPU_ONLY)})
    return rows


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def local_prometheus(target: str, workdir: Path, scrape_interval: str = "1s") -> Iterator[str]:
    """A Prometheus on a free loopback port scraping `target` (host:port of /metrics); yields its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("the prometheus binary is missing (Debian package `prometheus`, scripts/setup_env.sh)")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": "triton", "static_configs": [{"targets": [target]}]}],
    }))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (workdir / "prometheus.log").open("wb")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready; see {workdir / 'prometheus.log'}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--rate", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--range", default="5m", help="what $__range stands for")
    args = parser.parse_args(argv)
    failed = 0
    for row in check(args.prometheus, args.rate, args.range):
        bad = row["status"] != "success" or (not row["series"] and not row["may_be_empty"])
        failed += bad
        print(f"{'FAIL' if bad else 'ok  '} {row['series']:3d} series  {row['panel']}: {row['error'] or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
