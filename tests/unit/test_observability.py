"""Dashboards and alert rules, checked offline (promtool from Debian's prometheus)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool missing: scripts/bootstrap.sh installs Debian's prometheus package (as root)"
    return path


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(GRAFANA.glob("*.json"))}


def expressions() -> list[str]:
    exprs = [t["expr"] for d in dashboards().values() for p in d["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return exprs


def metric_names() -> set[str]:
    """Every hybridpd metric the dashboards and rules read (histograms by base name)."""
    names = set()
    for e in expressions():
        for m in re.findall(r"\b((?:ray_)?hybridpd_[a-z_]+)", e):
            names.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return names


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    subprocess.run([promtool(), "check", "rules", str(RULES)], check=True, capture_output=True)
    res = subprocess.run(
        [promtool(), "test", "rules", "rules_test.yaml"], cwd=RULES.parent, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboards_are_generated_from_the_script() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboards", ROOT / "scripts" / "build_dashboards.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert set(mod.DASHBOARDS) == set(dashboards())
    for name, dash in mod.DASHBOARDS.items():
        assert json.loads(json.dumps(dash, sort_keys=True)) == dashboards()[name], "%s is stale" % name


def test_dashboard_structure() -> None:
    uids = [d["uid"] for d in dashboards().values()]
    assert len(uids) == len(set(uids)) == 3
    for name, d in dashboards().items():
        assert [v["name"] for v in d["templating"]["list"]] == ["datasource"], name
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
        cells = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert {"h", "w", "x", "y"} <= set(g) and g["x"] + g["w"] <= 24, (name, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, "%s: panel %r overlaps another" % (name, p["title"])
                    cells.add((x, y))
            assert p["datasource"]["uid"] == "${datasource}"
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_every_expression_parses(tmp_path: Path) -> None:
    rules = [
        {"record": "hybridpd:check_%d" % i, "expr": e.replace("$__rate_interval", "1m")}
        for i, e in enumerate(expressions())
    ]
    f = tmp_path / "exprs.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    res = subprocess.run([promtool(), "check", "rules", str(f)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(rules) > 30
