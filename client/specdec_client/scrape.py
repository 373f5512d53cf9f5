"""Read Triton's Prometheus endpoint (/metrics): samples, sums over label matches, and differences.

A small parser of the text exposition format as tritonserver writes it (no escaped quotes in label values,
no timestamps); enough for tests and the benchmark harness, with no extra dependency.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

LabelSet = frozenset[tuple[str, str]]


@dataclass
class Scrape:
    """One scrape: value of every (metric name, label set)."""

    samples: dict[tuple[str, LabelSet], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        out = cls()
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.match(line.strip())
            if match is None:
                continue
            name, _, labels, value = match.groups()
            label_set = frozenset(_LABEL.findall(labels or ""))
            out.samples[(name, label_set)] = float(value)
        return out

    def total(self, name: str, **match: str) -> float:
        """Sum of `name` over the label sets that include `match` (0 when none)."""
        wanted = set(match.items())
        return sum(v for (n, labels), v in self.samples.items() if n == name and wanted <= labels)

    def values(self, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
        wanted = set(match.items())
        return [(dict(labels), v) for (n, labels), v in self.samples.items() if n == name and wanted <= labels]

    def __sub__(self, before: Scrape) -> Scrape:
        """Per-sample difference (counters and histograms: what happened between two scrapes)."""
        return Scrape({key: value - before.samples.get(key, 0.0) for key, value in self.samples.items()})


def scrape(url: str, timeout_s: float = 10.0) -> Scrape:
    """GET a Prometheus endpoint, e.g. http://127.0.0.1:8002/metrics."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return Scrape.parse(resp.read().decode("utf-8"))


def wait_for(url: str, condition: Callable[[Scrape], bool], timeout_s: float = 10.0) -> Scrape:
    """Scrape until `condition` holds (metrics are recorded just after a request's last response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = scrape(url)
        if condition(current) or time.monotonic() > deadline:
            return current
        time.sleep(0.05)
