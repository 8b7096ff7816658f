"""What the serving path costs on top of the engine: ``hybridpd bench overhead``.

    hybridpd bench overhead [--quick] [--json bench/results/overhead.json]

In one run, the same native engine and the same requests (distinct random
token prompts, so no cache hits; greedy; ``ignore_eos``):

* ``engine``: the engine driven in this process (no Ray, no router), with
  the torch thread count the actors run with; a request's TTFT is the time
  from ``add_request`` to its first token, its ITLs the gaps between its
  later tokens;
* ``stack``: ``hybridpd up`` with one prefill and one decode actor, driven
  over HTTP (``/v1/completions``, SSE streaming); TTFT is request sent to
  first token received, ITL the gaps between tokens received (a chunk of k
  tokens after a gap g counts as k gaps of g/k).

Both at concurrency 1 and 4, with p50/p99 and output throughput, and the
targets of issue #18 checked in the JSON (``checks``): stack TTFT p50 at
most the engine's + 25 ms at concurrency 1; stack ITL p50 at most 1.3x the
engine's, at concurrency 1 and 4. The two sides alternate, request batch by
request batch (and which goes first), so a load spike from another process
hits both.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.report import write_report
from launch.stack_process import StackProcess

#: torch threads in an actor: Ray gives an actor with num_cpus=0 OMP_NUM_THREADS=1
ACTOR_THREADS = 1
TTFT_BUDGET_MS = 25.0
ITL_RATIO_BUDGET = 1.3


def _pcts(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 2048) for _ in range(length)] for _ in range(n)]


class EngineSide:
    """The native engine in this process, configured as the stack's actors are."""

    def __init__(self, max_model_len: int, model: str) -> None:
        import torch

        from hybridpd.config import load_config
        from hybridpd.engine.native.engine import NativeEngine

        torch.set_num_threads(ACTOR_THREADS)
        self.engine = NativeEngine(load_config(overrides={"max_model_len": max_model_len, "model": model}))
        self.n = 0

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams

        t0 = time.perf_counter()
        rids = []
        for p in prompts:
            self.n += 1
            rid = RequestId("ovh-%d" % self.n)
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(EngineRequest(rid, tuple(p), sp))
            rids.append(rid)
        times: dict[str, list[float]] = {r: [] for r in rids}
        while self.engine.has_work():
            for o in self.engine.step():
                now = time.perf_counter()
                times[o.request_id].extend([now] * len(o.new_token_ids))
        return [_timing(t0, times[r]) for r in rids]


def _timing(t0: float, token_times: list[float]) -> dict[str, Any]:
    """TTFT and per-token gaps from the arrival time of each token."""
    itl = []
    last = token_times[0]
    i = 1
    while i < len(token_times):
        j = i
        while j < len(token_times) and token_times[j] == token_times[i]:
            j += 1
        gap = (token_times[i] - last) / (j - i)
        itl.extend([gap] * (j - i))
        last = token_times[i]
        i = j
    return {"ttft_s": token_times[0] - t0, "itl_s": itl, "tokens": len(token_times), "end": token_times[-1]}


def _stream_one(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            times.extend([now] * len(ids))
    if len(times) != max_tokens:
        raise RuntimeError("stream returned %d tokens, wanted %d" % (len(times), max_tokens))
    return _timing(t0, times)


class StackSide:
    """HTTP clients as a serving benchmark has them: one keep-alive connection per
    client thread (a fresh ``httpx.Client`` per request alone costs ~20 ms here)."""

    def __init__(self, url: str, model: str, concurrency: int) -> None:
        self.url = url
        self.model = model
        self.pool = concurrent.futures.ThreadPoolExecutor(max(concurrency, 1))
        self.local = threading.local()

    def _client(self) -> httpx.Client:
        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client()
        return self.local.client

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        return list(self.pool.map(lambda p: _stream_one(self._client(), self.url, self.model, p, max_tokens), prompts))


def _summary(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ttft = [r["ttft_s"] * 1e3 for r in rows]
    itl = [x * 1e3 for r in rows for x in r["itl_s"]]
    return {
        "requests": len(rows),
        "ttft_ms": _pcts(ttft),
        "itl_ms": _pcts(itl),
        "output_tokens_per_s": sum(r["tokens"] for r in rows) / wall_s if wall_s else 0.0,
    }


def run(
    json_path: Path, quick: bool, prompt_tokens: int = 1024, output_tokens: int = 32, model: str = "tiny"
) -> dict[str, Any]:
    reps = 4 if quick else 12  # batches per concurrency level and side
    levels = (1, 4)
    max_len = prompt_tokens + output_tokens + 64
    engine = EngineSide(max_len, model)
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {"engine": {c: [] for c in levels}, "stack": {}}
    walls: dict[str, dict[int, float]] = {"engine": dict.fromkeys(levels, 0.0), "stack": dict.fromkeys(levels, 0.0)}
    rows["stack"] = {c: [] for c in levels}
    seed = 0
    with tempfile.TemporaryDirectory(prefix="hybridpd-overhead-") as tmp:
        args = ["--num-prefill", "1", "--num-decode", "1", "--max-model-len", str(max_len), "--model", model]
        with StackProcess(Path(tmp), args) as st:
            sides: dict[str, EngineSide | StackSide] = {
                "engine": engine,
                "stack": StackSide(st.http, model, max(levels)),
            }
            # warm-up at the highest concurrency: first requests pay lazy initialisation
            # (engine buffers, client threads and their connections) on both sides
            for side in sides.values():
                side.batch(_prompts(max(levels), prompt_tokens, 999), output_tokens)
            total = sum(reps for _ in levels) * len(sides)
            with tqdm(total=total, desc="overhead", unit="batch") as bar:
                for c in levels:
                    for _ in range(reps):
                        seed += 1
                        prompts = _prompts(c, prompt_tokens, seed)  # fresh tokens: no cache hits
                        order = list(sides.items())
                        for name, side in order if seed % 2 else order[::-1]:  # alternate which side goes first
                            t0 = time.perf_counter()
                            got = side.batch(prompts, output_tokens)
                            walls[name][c] += time.perf_counter() - t0
                            rows[name][c].extend(got)
                            bar.update(1)
    results = {name: {"concurrency_%d" % c: _summary(rows[name][c], walls[name][c]) for c in levels} for name in rows}
    e1, s1 = results["engine"]["concurrency_1"], results["stack"]["concurrency_1"]
    checks: dict[str, Any] = {
        "ttft_p50_c1_over_engine_ms": s1["ttft_ms"]["p50"] - e1["ttft_ms"]["p50"],
        "ttft_ok": s1["ttft_ms"]["p50"] <= e1["ttft_ms"]["p50"] + TTFT_BUDGET_MS,
    }
    for c in levels:
        e, s = results["engine"]["concurrency_%d" % c], results["stack"]["concurrency_%d" % c]
        ratio = s["itl_ms"]["p50"] / e["itl_ms"]["p50"] if e["itl_ms"]["p50"] else float("nan")
        checks["itl_p50_ratio_c%d" % c] = ratio
        checks["itl_ok_c%d" % c] = ratio <= ITL_RATIO_BUDGET
    out = {
        "workload": {
            "model": model,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "batches_per_level": reps,
            "concurrency": list(levels),
            "actor_torch_threads": ACTOR_THREADS,
            "cpu_count": os.cpu_count(),
        },
        "quick": quick,
        "budgets": {"ttft_ms_over_engine": TTFT_BUDGET_MS, "itl_ratio": ITL_RATIO_BUDGET},
        "results": results,
        "checks": checks,
    }
    bars = {
        "engine TTFT": e1["ttft_ms"]["p50"],
        "stack TTFT": s1["ttft_ms"]["p50"],
        "engine ITLx10": 10 * e1["itl_ms"]["p50"],
        "stack ITLx10": 10 * s1["itl_ms"]["p50"],
    }
    write_report(json_path, out, bars, "ms (p50, concurrency 1)", "serving-path overhead")
    return out
