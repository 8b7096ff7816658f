"""Generate the Grafana dashboards in ``deploy/grafana/`` (committed).

    .venv/bin/python scripts/build_dashboards.py

Every panel reads a ``${datasource}`` Prometheus variable. Router metrics come
from the router's ``/metrics`` (``hybridpd_*``); actor metrics from Ray's
metrics endpoint (Ray prefixes them: ``ray_hybridpd_*``). Tests parse every
expression with promtool and check each metric against a live scrape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
DS = {"type": "prometheus", "uid": "${datasource}"}


def q(expr: str, legend: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend, "datasource": DS}


def quantiles(metric: str, by: str = "") -> list[dict[str, Any]]:
    grp = "le" + ("," + by if by else "")
    return [
        q(
            "histogram_quantile(%s, sum by (%s) (rate(%s_bucket[$__rate_interval])))" % (p, grp, metric),
            "p%s%s" % (int(float(p) * 100), (" {{%s}}" % by) if by else ""),
        )
        for p in ("0.5", "0.95", "0.99")
    ]


def panel(title: str, targets: list[dict[str, Any]], unit: str = "short", kind: str = "timeseries") -> dict[str, Any]:
    return {
        "type": kind,
        "title": title,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }


def dashboard(uid: str, title: str, panels: list[dict[str, Any]]) -> dict[str, Any]:
    laid = []
    for i, p in enumerate(panels):
        p = dict(p)
        p["id"] = i + 1
        p["gridPos"] = {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8}
        for j, t in enumerate(p["targets"]):
            t["refId"] = chr(ord("A") + j)
        laid.append(p)
    return {
        "uid": uid,
        "title": title,
        "tags": ["hybridpd"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": laid,
    }


OVERVIEW = dashboard(
    "hybridpd-overview",
    "hybridpd / Overview",
    [
        panel("Time to first token", quantiles("hybridpd_ttft_seconds"), "s"),
        panel("Inter-token latency", quantiles("hybridpd_inter_token_latency_seconds"), "s"),
        panel(
            "Throughput (tokens/s)",
            [
                q("sum(rate(hybridpd_completion_tokens_total[$__rate_interval]))", "generated"),
                q("sum(rate(hybridpd_prompt_tokens_total[$__rate_interval]))", "prompt"),
            ],
            "short",
        ),
        panel(
            "Prefix hit rate (cached / prompt tokens)",
            [
                q(
                    "sum(rate(hybridpd_cached_tokens_total[$__rate_interval])) / "
                    "clamp_min(sum(rate(hybridpd_prompt_tokens_total[$__rate_interval])), 1)",
                    "hit rate",
                ),
            ],
            "percentunit",
        ),
        panel(
            "EAGLE mean acceptance length",
            [
                q(
                    "sum(rate(ray_hybridpd_eagle_emitted_tokens_total[$__rate_interval])) / "
                    "clamp_min(sum(rate(ray_hybridpd_eagle_steps_total[$__rate_interval])), 1)",
                    "tokens / step",
                ),
            ],
            "short",
        ),
        panel(
            "Requests by status",
            [
                q("sum by (api, status) (rate(hybridpd_requests_total[$__rate_interval]))", "{{api}} {{status}}"),
            ],
            "reqps",
        ),
        panel("End-to-end latency", quantiles("hybridpd_e2e_latency_seconds"), "s"),
        panel("Queue time", quantiles("hybridpd_queue_seconds"), "s"),
        panel(
            "Time to first token by stage (mean)",
            [
                q(
                    "sum by (stage) (rate(hybridpd_ttft_stage_seconds_sum[$__rate_interval])) / "
                    "clamp_min(sum by (stage) (rate(hybridpd_ttft_stage_seconds_count[$__rate_interval])), 1e-9)",
                    "{{stage}}",
                ),
                q(
                    "sum(rate(hybridpd_queue_seconds_sum[$__rate_interval])) / "
                    "clamp_min(sum(rate(hybridpd_queue_seconds_count[$__rate_interval])), 1e-9)",
                    "queue",
                ),
            ],
            "s",
        ),
    ],
)

STATE_PLANE = dashboard(
    "hybridpd-state-plane",
    "hybridpd / Cache and state plane",
    [
        panel(
            "Routing decisions",
            [
                q("sum by (decision) (rate(hybridpd_routing_decisions_total[$__rate_interval]))", "{{decision}}"),
            ],
            "reqps",
        ),
        panel("Index lookup latency", quantiles("hybridpd_index_lookup_seconds"), "s"),
        panel(
            "Index lookups by the server that answered (replica: redis_read_replicas)",
            [q("sum by (source) (rate(hybridpd_index_lookups_total[$__rate_interval]))", "{{source}}")],
            "reqps",
        ),
        panel(
            "Prompt tokens by prefix outcome (why a prefix missed)",
            [q("sum by (outcome) (rate(hybridpd_prefix_tokens_total[$__rate_interval]))", "{{outcome}}")],
            "short",
        ),
        panel(
            "Reusable prefix restored (hit / (hit + checkpoint_missing + evicted))",
            [
                q(
                    'sum(rate(hybridpd_prefix_tokens_total{outcome="hit"}[$__rate_interval]))'
                    ' / sum(rate(hybridpd_prefix_tokens_total{outcome=~"hit|checkpoint_missing|evicted"}'
                    "[$__rate_interval]))",
                    "restored share",
                )
            ],
            "percentunit",
        ),
        panel(
            "Index promises: tokens kept vs broken (broken: the index claimed what the engine could not deliver)",
            [
                q("sum by (outcome) (rate(hybridpd_index_promise_tokens_total[$__rate_interval]))", "{{outcome}}"),
                q("sum(rate(hybridpd_index_store_repairs_total[$__rate_interval]))", "store entries repaired /s"),
            ],
            "short",
        ),
        panel(
            "State checkpoints in the store (per instance, bounded by store_state_budget_mb)",
            [q("sum by (instance) (ray_hybridpd_store_state_bytes)", "{{instance}}")],
            "bytes",
        ),
        panel(
            "State checkpoints: bytes put and evictions by value",
            [
                q("sum(rate(ray_hybridpd_checkpoint_state_bytes_total[$__rate_interval]))", "state bytes put/s"),
                q("sum(rate(ray_hybridpd_checkpoint_evictions_total[$__rate_interval]))", "evictions/s"),
            ],
            "short",
        ),
        panel(
            "Checkpoint placement: positions placed for the request that diverges first",
            [q("sum(rate(hybridpd_placed_checkpoints_total[$__rate_interval]))", "placed/s")],
            "short",
        ),
        panel(
            "Prefill tokens: computed vs restored",
            [
                q("sum(rate(ray_hybridpd_prefill_computed_tokens_total[$__rate_interval]))", "computed"),
                q("sum(rate(ray_hybridpd_prefill_loaded_tokens_total[$__rate_interval]))", "restored"),
            ],
            "short",
        ),
        panel(
            "Checkpoint exports",
            [
                q("sum(rate(ray_hybridpd_checkpoint_exports_total[$__rate_interval]))", "exports/s"),
                q("sum(rate(ray_hybridpd_checkpoint_export_failures_total[$__rate_interval]))", "failures/s"),
            ],
            "short",
        ),
        panel(
            "Store bytes",
            [
                q("sum(rate(ray_hybridpd_checkpoint_export_bytes_total[$__rate_interval]))", "put"),
                q("sum(rate(ray_hybridpd_store_get_bytes_total[$__rate_interval]))", "get"),
            ],
            "Bps",
        ),
        panel("Store put latency", quantiles("ray_hybridpd_store_put_seconds"), "s"),
        panel("Store get latency", quantiles("ray_hybridpd_store_get_seconds"), "s"),
        panel(
            "Store loads",
            [
                q("sum(rate(ray_hybridpd_prefill_store_loads_total[$__rate_interval]))", "loaded"),
                q("sum(rate(ray_hybridpd_prefill_store_load_failures_total[$__rate_interval]))", "failed (recomputed)"),
            ],
            "short",
        ),
        panel("NIXL handoff read latency", quantiles("ray_hybridpd_nixl_read_seconds"), "s"),
        panel("Handoff latency (offer to release)", quantiles("ray_hybridpd_handoff_seconds"), "s"),
        panel(
            "NIXL bytes",
            [
                q("sum(rate(ray_hybridpd_handoff_offered_bytes_total[$__rate_interval]))", "offered"),
                q("sum(rate(ray_hybridpd_nixl_read_bytes_total[$__rate_interval]))", "read"),
                q(
                    "sum(rate(ray_hybridpd_handoff_skipped_bytes_total[$__rate_interval]))",
                    "not read: held by decode (delta handoffs)",
                ),
            ],
            "Bps",
        ),
        panel(
            "Integrity: checksum failures and expired handoffs",
            [
                q("sum(increase(ray_hybridpd_checksum_failures_total[$__rate_interval]))", "checksum failures"),
                q("sum(increase(ray_hybridpd_handoffs_expired_total[$__rate_interval]))", "expired handoffs"),
            ],
            "short",
        ),
    ],
)

INSTANCES = dashboard(
    "hybridpd-instances",
    "hybridpd / Instances",
    [
        panel("Prefill queued tokens", [q("sum by (instance) (ray_hybridpd_prefill_queued_tokens)", "{{instance}}")]),
        panel(
            "Running requests",
            [
                q("sum by (instance) (ray_hybridpd_prefill_running_requests)", "{{instance}}"),
                q("sum by (instance) (ray_hybridpd_decode_running_requests)", "{{instance}}"),
            ],
        ),
        panel("Free KV blocks", [q("sum by (instance) (ray_hybridpd_free_kv_blocks)", "{{instance}}")]),
        panel("Prefill latency", quantiles("ray_hybridpd_prefill_seconds", "instance"), "s"),
        panel(
            "Decode tokens/s",
            [
                q("sum by (instance) (rate(ray_hybridpd_decode_tokens_total[$__rate_interval]))", "{{instance}}"),
            ],
        ),
        panel("EAGLE tokens per step", quantiles("ray_hybridpd_eagle_acceptance_length"), "short"),
    ],
)

DASHBOARDS = {"overview.json": OVERVIEW, "state-plane.json": STATE_PLANE, "instances.json": INSTANCES}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, dash in DASHBOARDS.items():
        (OUT / name).write_text(json.dumps(dash, indent=2, sort_keys=True) + "\n")
        print("wrote", OUT / name)


if __name__ == "__main__":
    main()
