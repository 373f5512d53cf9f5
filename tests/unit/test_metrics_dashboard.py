"""docker/monitoring: the Grafana dashboard is current, uses only metrics that exist, and fits Grafana's schema."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from specdec import metrics as m

REPO_ROOT = Path(__file__).resolve().parents[2]
MONITORING = REPO_ROOT / "docker" / "monitoring"
_spec = importlib.util.spec_from_file_location("monitoring_dashboard", MONITORING / "dashboard.py")
dashboard_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dashboard_module)

METRIC = re.compile(r"\b((?:specdec|nv)_[a-z_]+)\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def committed() -> dict:
    return json.loads(dashboard_module.OUT.read_text())


def expressions(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return out


def test_committed_dashboard_is_generated_from_the_catalogue():
    assert dashboard_module.OUT.read_text() == dashboard_module.render(), "run python docker/monitoring/dashboard.py"


def test_every_queried_metric_exists():
    known = {spec.name for spec in m.ALL_METRICS} | set(dashboard_module.TRITON_METRICS)
    histograms = {spec.name for spec in m.ALL_METRICS if spec.kind == "histogram"}
    used = {name for expr in expressions(committed()) for name in METRIC.findall(expr)}
    for name in used:
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s) and name[: -len(s)] in histograms),
                    name)
        assert base in known, name
    # Every speculation metric of the catalogue is on the dashboard.
    assert {spec.name for spec in m.ALL_METRICS if spec.name.startswith("specdec_")} - {
        n.removesuffix("_bucket") for n in used} == set()


def test_layout_and_tiers():
    dashboard = committed()
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert [r.split(" ·")[0] for r in rows] == ["Tier 1", "Tier 2", "Tier 3"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, panel["title"]
        cells |= area
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_provisioning_fits_the_dashboard_and_the_compose_stack():
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    variable = next(v for v in committed()["templating"]["list"] if v["name"] == "datasource")
    assert datasource["datasources"][0]["uid"] == variable["current"]["value"]
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/specdec.yml").read_text())
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    assert compose["include"] == ["../docker-compose.yml"]
    grafana_mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"]
                          if v.startswith("./"))
    assert grafana_mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    for source in grafana_mounts:
        assert (MONITORING / source).is_dir(), source
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    base = yaml.safe_load((REPO_ROOT / "docker" / "docker-compose.yml").read_text())
    assert "8002:8002" in base["services"]["triton"]["ports"]
    assert "triton:8002" in targets


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed (needed for @grafana/schema)")
def test_dashboard_matches_grafanas_dashboard_schema():
    done = dashboard_module.schema_check(dashboard_module.render())
    assert done.returncode == 0, done.stdout + done.stderr
    # The check has teeth: an unknown panel field is a type error.
    broken = committed()
    broken["panels"][1]["colour"] = "red"
    done = dashboard_module.schema_check(json.dumps(broken))
    assert done.returncode != 0 and "colour" in done.stdout
