"""Metrics of the running stack: every metric the dashboards and alerts use is
really exported, and a real Prometheus scrapes the stack and answers a
dashboard query."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import yaml
from openai import OpenAI

from hybridpd.procs import free_port
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt
from tests.unit.test_observability import metric_names
from tests.wait import Pending, wait_until

RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yaml"


def _traffic(stack: Stack) -> None:
    """Requests that touch every metric: local + store hits, EAGLE decode, streaming."""
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
    base = list(prompt(280, 901))
    client.completions.create(
        model="tiny", prompt=base, max_tokens=6, temperature=0, extra_body={"hybridpd_prefill_instance": "prefill-0"}
    )
    ext = base + list(prompt(30, 902))
    stack.wait_store_hit(ext)  # published asynchronously: then prefill-1 loads it from the store
    for inst in ("prefill-0", "prefill-1"):
        client.completions.create(
            model="tiny",
            prompt=ext,
            max_tokens=6,
            temperature=0,
            extra_body={"hybridpd_prefill_instance": inst},
        )
    list(client.completions.create(model="tiny", prompt=base[:50], max_tokens=6, temperature=0, stream=True))


def _scraped_names(url: str) -> set[str]:
    text = httpx.get(url, timeout=10).text
    return {re.sub(r"_(bucket|sum|count|total|created)$", "", m) for m in re.findall(r"^([a-zA-Z_:]+)", text, re.M)}


def test_dashboard_and_alert_metrics_are_exported(stack: Stack) -> None:
    _traffic(stack)
    wanted = {re.sub(r"_total$", "", n) for n in metric_names()}

    def all_exported() -> bool | Pending:
        missing = wanted - _scraped_names(stack.http + "/metrics") - _scraped_names(stack.ray_metrics)
        return Pending(sorted(missing)) if missing else True

    # Ray's metrics agent reports every few seconds
    wait_until(all_exported, 60, 2, "every metric the dashboards and alerts use to be exported (last: missing ones)")


def test_prometheus_scrapes_the_stack(stack: Stack, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus missing: scripts/bootstrap.sh installs it (as root)"
    port = free_port()
    router = stack.http.removeprefix("http://")
    ray = stack.ray_metrics.removeprefix("http://").removesuffix("/metrics")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [%s]\n"
        "scrape_configs:\n"
        "  - {job_name: hybridpd-router, static_configs: [{targets: ['%s']}]}\n"
        "  - {job_name: hybridpd-ray, static_configs: [{targets: ['%s']}]}\n"
        % (Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yaml", router, ray)
    )
    proc = subprocess.Popen(
        [
            prometheus,
            "--config.file=%s" % cfg,
            "--storage.tsdb.path=%s" % (tmp_path / "data"),
            "--web.listen-address=127.0.0.1:%d" % port,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _traffic(stack)
        api = "http://127.0.0.1:%d/api/v1/query" % port
        queries = [
            'sum(hybridpd_requests_total{status="ok"})',  # requests by status panel
            "sum(rate(hybridpd_prompt_tokens_total[1m]))",  # throughput panel
            "sum by (instance) (ray_hybridpd_free_kv_blocks)",  # instances dashboard
        ]

        def result(query: str) -> list:
            # until its storage is ready Prometheus answers 503 "Service Unavailable"
            # (plain text): raise_for_status turns that into a retried HTTPError
            return httpx.get(api, params={"query": query}, timeout=5).raise_for_status().json()["data"]["result"]

        def answered() -> dict[str, list] | Pending:
            results = {q: result(q) for q in queries}
            return results if all(results.values()) else Pending(results)

        # Prometheus scrapes every second and starts in a moment (slower on a busy machine)
        wait_until(answered, 40, 2, "Prometheus to answer every dashboard query", retry_on=(httpx.HTTPError,))
        rules = httpx.get("http://127.0.0.1:%d/api/v1/rules" % port, timeout=5).json()["data"]["groups"]
        assert rules and len(rules[0]["rules"]) == len(yaml.safe_load(RULES_FILE.read_text())["groups"][0]["rules"])
    finally:
        proc.terminate()
        proc.wait(10)
