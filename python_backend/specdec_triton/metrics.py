"""specdec.metrics specs as Triton custom metrics (pb_utils.MetricFamily) on the server's metrics port.

Families are created once per process and metrics once per label set; every later update is one message
to the server. Histograms need a Python backend with `MetricFamily.HISTOGRAM` (tritonserver 2.51 has it);
where it is missing, a histogram is exported as two counters `<name>_sum` and `<name>_count` (no buckets),
which is what Prometheus queries of a mean need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import triton_python_backend_utils as pb_utils
from specdec.metrics import MetricSpec


def has_histogram() -> bool:
    """Whether this Python backend has histogram metrics (pb_utils.MetricFamily is only attached once the
    stub serves a model, not while it auto-completes a config: look it up at run time)."""
    return hasattr(pb_utils.MetricFamily, "HISTOGRAM")


def _kind(kind: str) -> Any:
    return getattr(pb_utils.MetricFamily, kind.upper())


class TritonMetricSink:
    """specdec.metrics.MetricSink over pb_utils; keeps every family and metric alive for the process."""

    def __init__(self) -> None:
        self.histograms = has_histogram()
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._failed: set[str] = set()

    def _family(self, name: str, kind: str, help_text: str) -> Any:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = pb_utils.MetricFamily(name=name, description=help_text,
                                                                  kind=_kind(kind))
        return family

    def _metric(self, spec: MetricSpec, labels: Mapping[str, str], suffix: str = "", kind: str | None = None) -> Any:
        key = (spec.name + suffix, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            if set(labels) != set(spec.labels):
                raise ValueError(f"{spec.name} takes labels {spec.labels}, got {sorted(labels)}")
            family = self._family(spec.name + suffix, kind or spec.kind, spec.help)
            extra = {"buckets": list(spec.buckets or ())} if (kind or spec.kind) == "histogram" else {}
            metric = self._metrics[key] = family.Metric(labels=dict(labels), **extra)
        return metric

    def increment(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        with self._guard(spec):
            self._metric(spec, labels).increment(float(value))

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        with self._guard(spec):
            self._metric(spec, labels).set(float(value))

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        with self._guard(spec):
            if self.histograms:
                self._metric(spec, labels).observe(float(value))
            else:
                self._metric(spec, labels, "_sum", "counter").increment(float(value))
                self._metric(spec, labels, "_count", "counter").increment(1.0)

    @contextlib.contextmanager
    def _guard(self, spec: MetricSpec) -> Iterator[None]:
        """A metric update never fails a request: log the first failure of each metric, then stay quiet."""
        try:
            yield
        except Exception as exc:
            if spec.name not in self._failed:
                self._failed.add(spec.name)
                pb_utils.Logger.log_warn(f"metric {spec.name} not updated: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Drop metrics before their families (the order the Python backend requires)."""
        self._metrics.clear()
        self._families.clear()
