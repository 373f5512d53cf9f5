"""Write the Grafana dashboard of specdec-triton (grafana/dashboards/specdec-triton.json) from the metric catalogue.

Metric names come from `specdec.metrics` (ours) and Triton's own families, so a renamed metric cannot leave a
stale panel behind: tests regenerate the JSON and compare. Three rows, the tiers of docs/OBSERVABILITY.md:
tier 1 throughput / latency / errors, tier 2 acceptance / verification, tier 3 CPU / GPU load and memory.

    python docker/monitoring/dashboard.py [--check] [--schema]

`--schema` type-checks the JSON against Grafana's dashboard schema: the `Dashboard` type that Grafana
generates from its CUE schema and ships in the npm package @grafana/schema (pinned in schema-check/), with
TypeScript's excess-property checks, so an unknown or misspelt field fails as well as a wrong type.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from specdec import metrics as m

HERE = Path(__file__).resolve().parent
OUT = HERE / "grafana" / "dashboards" / "specdec-triton.json"
SCHEMA_CHECK = HERE / "schema-check"
UID = "specdec-triton"
DS = {"type": "prometheus", "uid": "${datasource}"}
SERVER = 'instance=~"$server"'
SPEC = f'{SERVER}, model="speculative_decoding", task=~"$task"'
WINDOW = "$__rate_interval"
# Triton's own families used below (tritonserver 2.51; GPU ones exist only on GPU servers).
TRITON_METRICS = (
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us", "nv_inference_exec_count",
    "nv_inference_count", "nv_inference_pending_request_count", "nv_cpu_utilization", "nv_cpu_memory_used_bytes",
    "nv_cpu_memory_total_bytes", "nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes",
    "nv_gpu_power_usage",
)


class Layout:
    """Places panels left to right on Grafana's 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = 0
        self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x = self.row_height = 0

    def add(self, panel: dict[str, Any], w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(kind: str, title: str, description: str, queries: list[tuple[str, str]], unit: str,
          **options: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if "min" in options:
        defaults["min"] = options.pop("min")
    if "max" in options:
        defaults["max"] = options.pop("max")
    if "thresholds" in options:
        defaults["thresholds"] = {"mode": "absolute", "steps": options.pop("thresholds")}
    return {
        "type": kind, "title": title, "description": description, "datasource": DS,
        "targets": [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def timeseries(title: str, description: str, queries: list[tuple[str, str]], unit: str, **options: Any) -> dict:
    options.setdefault("legend", {"displayMode": "list", "placement": "bottom", "showLegend": True})
    options.setdefault("tooltip", {"mode": "multi", "sort": "none"})
    return panel("timeseries", title, description, queries, unit, **options)


def quantiles(spec: m.MetricSpec, by: str = "task") -> list[tuple[str, str]]:
    bucket = f"{spec.name}_bucket"
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({bucket}{{{SPEC}}}[{WINDOW}])))",
             f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.99)]


def per_second(spec: m.MetricSpec, by: str = "task", where: str = SPEC) -> str:
    return f"sum by ({by}) (rate({spec.name}{{{where}}}[{WINDOW}]))"


def dashboard() -> dict[str, Any]:
    lay = Layout()
    ensemble = f'{SERVER}, model="ensemble"'

    lay.row("Tier 1 · throughput, latency, errors")
    lay.add(timeseries("Requests/s", "Finished generations per second by outcome (specdec_requests_total) and "
                       "Triton's successful ensemble requests.",
                       [(per_second(m.REQUESTS, "task, outcome"), "{{task}} {{outcome}}"),
                        (f"sum(rate(nv_inference_request_success{{{ensemble}}}[{WINDOW}]))", "ensemble (Triton)")],
                       "reqps"))
    lay.add(timeseries("Output tokens/s", "Generated tokens per second by task.",
                       [(per_second(m.OUTPUT_TOKENS), "{{task}}"),
                        (f"sum(rate({m.OUTPUT_TOKENS.name}{{{SPEC}}}[{WINDOW}]))", "all")], "short"))
    lay.add(timeseries("Errors/s by kind", "specdec_errors_total (draft_failure: degraded to plain decoding, "
                       "not failed) and Triton's failed ensemble requests.",
                       [(per_second(m.ERRORS, "task, kind"), "{{task}} {{kind}}"),
                        (f"sum(rate(nv_inference_request_failure{{{ensemble}}}[{WINDOW}]))",
                         "ensemble failures (Triton)")],
                       "reqps"))
    lay.add(timeseries("Request latency", "Arrival at speculative_decoding to its last response.",
                       quantiles(m.DURATION), "s"))
    lay.add(timeseries("Time to first token", "Arrival at speculative_decoding to its first token.",
                       quantiles(m.TTFT), "s"))
    lay.add(timeseries("Inter-token latency", "Per request: (last token - first token) / (tokens - 1).",
                       quantiles(m.ITL), "s"))
    lay.add(timeseries("Queue time per request (Triton)", "nv_inference_queue_duration_us / requests, per model: "
                       "time waiting in the scheduler (sequence batcher for the decoders).",
                       [(f"sum by (model) (rate(nv_inference_queue_duration_us{{{SERVER}}}[{WINDOW}])) / 1e6 / "
                         f"sum by (model) (rate(nv_inference_request_success{{{SERVER}}}[{WINDOW}]))", "{{model}}")],
                       "s"), w=12)
    lay.add(timeseries("Compute time per call (Triton)", "nv_inference_compute_infer_duration_us per request of the "
                       "draft and target models: one draft call proposes k tokens, one target call verifies them.",
                       [(f"sum by (model) (rate(nv_inference_compute_infer_duration_us{{{SERVER}, "
                         f'model=~"target_model|draft_model"}}[{WINDOW}])) / 1e6 / sum by (model) '
                         f"(rate(nv_inference_request_success{{{SERVER}, model=~\"target_model|draft_model\"}}"
                         f"[{WINDOW}]))", "{{model}}")], "s"), w=12)

    lay.row("Tier 2 · speculation: acceptance and verification")
    accepted, drafted = m.ACCEPTED_DRAFT_TOKENS.name, m.DRAFT_TOKENS.name
    lay.add(timeseries("Acceptance rate α", "Accepted / proposed draft tokens: from the counters over the rate "
                       "window, and the server's own windowed gauge (specdec_acceptance_rate).",
                       [(f"{per_second(m.ACCEPTED_DRAFT_TOKENS)} / {per_second(m.DRAFT_TOKENS)}",
                         "{{task}} (counters)"),
                        (f"avg by (task) ({m.ACCEPTANCE_RATE.name}{{{SPEC}}})", "{{task}} (gauge)")],
                       "percentunit", min=0, max=1))
    lay.add(timeseries("Mean accepted length τ", "Tokens emitted per verification pass (accepted drafts + the "
                       "bonus token).",
                       [(f"({per_second(m.ACCEPTED_DRAFT_TOKENS)} + {per_second(m.VERIFICATION_PASSES)}) / "
                         f"{per_second(m.VERIFICATION_PASSES)}", "{{task}} (counters)"),
                        (f"avg by (task) ({m.MEAN_ACCEPTED_LENGTH.name}{{{SPEC}}})", "{{task}} (gauge)")], "short",
                       min=0))
    lay.add(timeseries("Speculation length and fallback", "Mean draft tokens per pass of the latest request, and "
                       "1 while a task runs in plain-decoding fallback.",
                       [(f"avg by (task) ({m.SPECULATION_LENGTH.name}{{{SPEC}}})", "k {{task}}"),
                        (f"max by (task) ({m.FALLBACK_ACTIVE.name}{{{SPEC}}})", "fallback {{task}}")], "short",
                       min=0))
    lay.add(panel("bargauge", "Accepted draft tokens by position", "Share of verification passes that accepted the "
                  "draft token at each position (position 0 = first proposed token).",
                  [(f"sum by (position) (increase({m.ACCEPTED_BY_POSITION.name}{{{SPEC}}}[$__range])) "
                    f"/ ignoring(position) group_left "
                    f"sum(increase({m.VERIFICATION_PASSES.name}{{{SPEC}}}[$__range]))", "{{position}}")],
                  "percentunit", min=0, max=1, orientation="vertical", displayMode="gradient",
                  reduceOptions={"calcs": ["lastNotNull"], "fields": "", "values": False}), w=8)
    lay.add(timeseries("Draft and verification work", "Draft tokens proposed, accepted (all, and those of prompt "
                       "lookup and of constrained requests' grammars), grammar-forbidden drafts cut, and "
                       "verification passes per second; requests per second by their drafter.",
                       [(f"sum(rate({drafted}{{{SPEC}}}[{WINDOW}]))", "proposed"),
                        (f"sum(rate({accepted}{{{SPEC}}}[{WINDOW}]))", "accepted"),
                        (f"sum(rate({m.LOOKUP_DRAFT_TOKENS.name}{{{SPEC}}}[{WINDOW}]))", "proposed by lookup"),
                        (f"sum(rate({m.LOOKUP_ACCEPTED_TOKENS.name}{{{SPEC}}}[{WINDOW}]))", "accepted from lookup"),
                        (f"sum(rate({m.GRAMMAR_DRAFT_TOKENS.name}{{{SPEC}}}[{WINDOW}]))", "proposed by grammars"),
                        (f"sum(rate({m.GRAMMAR_ACCEPTED_TOKENS.name}{{{SPEC}}}[{WINDOW}]))",
                         "accepted from grammars"),
                        (f"sum(rate({m.GRAMMAR_PRUNED_TOKENS.name}{{{SPEC}}}[{WINDOW}]))", "cut by grammars"),
                        (f"sum(rate({m.VERIFICATION_PASSES.name}{{{SPEC}}}[{WINDOW}]))", "verification passes"),
                        (f"sum(rate({m.TARGET_CALLS.name}{{{SPEC}}}[{WINDOW}]))", "target calls"),
                        (f"sum(rate({m.DRAFT_CALLS.name}{{{SPEC}}}[{WINDOW}]))", "draft calls"),
                        (f"sum by (drafter) (rate({m.DRAFTER_REQUESTS.name}{{{SPEC}}}[{WINDOW}]))",
                         "requests drafted by {{drafter}}")], "short"), w=8)
    lay.add(timeseries("Generations in flight and KV slots", "Requests generating now; sequence slots and KV blocks "
                       "held by live sequences / in each decoder instance's pool.",
                       [(f"sum({m.ACTIVE_REQUESTS.name}{{{SERVER}}})", "generating"),
                        (f"sum by (model) ({m.KV_SLOTS_IN_USE.name}{{{SERVER}}})", "slots in use {{model}}"),
                        (f"sum by (model) ({m.KV_SLOTS.name}{{{SERVER}}})", "slots {{model}}"),
                        (f"sum by (model) ({m.KV_BLOCKS_IN_USE.name}{{{SERVER}}})", "KV blocks in use {{model}}"),
                        (f"sum by (model) ({m.KV_BLOCKS.name}{{{SERVER}}})", "KV blocks {{model}}")], "short", min=0),
            w=8)
    lay.add(timeseries("Where a generation's time goes", "Seconds per second that generating sequences spend in "
                       "each phase of their iterations (draft, lookup, wait, target, accept, other), summed over "
                       "sequences.",
                       [(f"sum by (phase) (rate({m.GENERATION_SECONDS.name}{{{SPEC}}}[{WINDOW}]))", "{{phase}}")],
                       "s", min=0), w=12)
    lay.add(timeseries("Decoder executions by batch size", "Executions per second of each decoder by how many "
                       "sequence steps they served (the bucket's upper bound): how well concurrent sequences batch.",
                       [(f"sum by (model, batch_size) (rate({m.DECODER_BATCHES.name}{{{SERVER}}}[{WINDOW}]))",
                         "{{model}} <= {{batch_size}}")], "short", min=0), w=12)
    lay.add(timeseries("Decoder mean batch", "Sequence steps per execution of each decoder (a packed request "
                       "carries a wave of steps, so Triton's own request counts undercount them).",
                       [(f"sum by (model) (rate({m.DECODER_STEPS.name}{{{SERVER}}}[{WINDOW}])) / sum by (model) "
                         f"(rate({m.DECODER_BATCHES.name}{{{SERVER}}}[{WINDOW}]))", "{{model}}")], "short", min=0),
            w=12)

    lay.row("Tier 3 · resources: CPU, GPU, memory")
    lay.add(timeseries("CPU utilisation (Triton)", "nv_cpu_utilization: the host's CPU load as Triton sees it.",
                       [(f"avg(nv_cpu_utilization{{{SERVER}}})", "CPU")], "percentunit", min=0, max=1))
    lay.add(timeseries("Host memory (Triton)", "nv_cpu_memory_used_bytes of nv_cpu_memory_total_bytes.",
                       [(f"sum(nv_cpu_memory_used_bytes{{{SERVER}}})", "used"),
                        (f"sum(nv_cpu_memory_total_bytes{{{SERVER}}})", "total")], "bytes", min=0))
    lay.add(timeseries("Model process memory", "Per model process: RSS, PSS (shares split, sums to the real total), "
                       "USS (private: what unloading it frees; the draft model's USS is the memory cost of "
                       "speculation).",
                       [(f"sum by (model) ({m.RESIDENT_MEMORY.name}{{{SERVER}}})", "RSS {{model}}"),
                        (f"sum by (model) ({m.PROPORTIONAL_MEMORY.name}{{{SERVER}}})", "PSS {{model}}"),
                        (f"sum by (model) ({m.UNIQUE_MEMORY.name}{{{SERVER}}})", "USS {{model}}"),
                        (f"sum by (model) ({m.KV_CACHE_BYTES.name}{{{SERVER}}})", "KV pool {{model}}"),
                        (f"sum by (model) ({m.KV_BYTES_IN_USE.name}{{{SERVER}}})", "KV in use {{model}}")], "bytes",
                       min=0))
    lay.add(timeseries("GPU utilisation (Triton, GPU servers)", "nv_gpu_utilization per GPU.",
                       [(f"nv_gpu_utilization{{{SERVER}}}", "{{gpu_uuid}}")], "percentunit", min=0, max=1))
    lay.add(timeseries("GPU memory (Triton, GPU servers)", "nv_gpu_memory_used_bytes per GPU.",
                       [(f"nv_gpu_memory_used_bytes{{{SERVER}}}", "used {{gpu_uuid}}"),
                        (f"nv_gpu_memory_total_bytes{{{SERVER}}}", "total {{gpu_uuid}}")], "bytes", min=0))
    lay.add(timeseries("GPU power (Triton, GPU servers)", "nv_gpu_power_usage per GPU.",
                       [(f"nv_gpu_power_usage{{{SERVER}}}", "{{gpu_uuid}}")], "watt", min=0))

    all_values = {"text": "All", "value": "$__all"}

    def query_variable(name: str, query: str) -> dict[str, Any]:
        return {"type": "query", "name": name, "label": name, "datasource": DS,
                "query": {"query": query, "refId": name}, "refresh": 2, "includeAll": True,
                "multi": True, "current": all_values, "options": [], "hide": 0, "sort": 1, "allValue": ".*"}

    variables = [
        {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
         "current": {"text": "Prometheus", "value": "prometheus"}, "hide": 0, "refresh": 1, "options": [],
         "includeAll": False, "multi": False},
        query_variable("server", "label_values(nv_inference_request_success, instance)"),
        query_variable("task", f"label_values({m.REQUESTS.name}, task)"),
    ]
    return {
        "uid": UID, "title": "specdec-triton: speculative decoding", "tags": ["triton", "speculative-decoding"],
        "description": "Three tiers: Triton's nv_inference_* (throughput, latency, errors), specdec_* speculation "
                       "metrics (acceptance, verification), and resources (CPU/GPU/memory).",
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "timepicker": {}, "timezone": "browser",
        "fiscalYearStartMonth": 0, "liveNow": False, "links": [],
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": variables},
        "panels": lay.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def schema_check(text: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run tsc on `const dashboard: Dashboard = <text>` (npm ci of the pinned packages on first use)."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed for the schema check (Debian: apt-get install npm)")
    if not (SCHEMA_CHECK / "node_modules" / ".bin" / "tsc").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"], cwd=SCHEMA_CHECK, check=True,
                       timeout=timeout_s)
    (SCHEMA_CHECK / "dashboard.check.ts").write_text(
        'import type { Dashboard } from "@grafana/schema";\n\nexport const dashboard: Dashboard = ' + text.strip()
        + ";\n")
    return subprocess.run([str(SCHEMA_CHECK / "node_modules" / ".bin" / "tsc"), "-p", "tsconfig.json"],
                          cwd=SCHEMA_CHECK, capture_output=True, text=True, timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON differs")
    parser.add_argument("--schema", action="store_true", help="type-check it against Grafana's dashboard schema")
    args = parser.parse_args(argv)
    text = render()
    if args.schema:
        done = schema_check(text)
        print(done.stdout + done.stderr or "dashboard JSON matches @grafana/schema's Dashboard type")
        if done.returncode:
            return done.returncode
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docker/monitoring/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
