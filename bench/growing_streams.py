"""The growing-streams workload: long prompts that grow every round.

S streams; stream s sends token-id prompts of length L0, L0 + D, ... up to
L1 to ``/v1/completions`` (streaming, greedy), one request per stream per
round, with a barrier after each round. Each prompt extends the previous one
by D tokens never seen before, so the ideal recompute per incremental request
is D. Variants (each on a fresh ``hybridpd up``, same workload):

* ``partial``: partial prefix caching at unit u (the default);
* ``aligned``: checkpoints only at Mamba-block boundaries (u = B);
* ``nocache``: prefix caching off;
* ``roundrobin``: partial, but routing ignores the index;
* ``partial_eagle`` / ``aligned_eagle``: the first two with EAGLE on (the native
  draft head replays no unit: the same hits as without EAGLE);
* ``vllm-direct``: plain ``vllm serve`` (no hybridpd) with the tiny Qwen3-Next,
  prefix caching at unit u, the baseline users would otherwise run;
* ``vllm-pd``: vLLM's own prefill/decode disaggregation (a prefill and a decode
  ``vllm serve`` with the same flags, NixlConnector, and a proxy:
  bench/vllm_pd.py), what users would run instead of our P/D;
* ``vllm-partial``: our stack with ``--engine vllm`` and the same model, so it
  compares with ``vllm-direct`` and ``vllm-pd`` model for model.

The vLLM variants need the vLLM environment (``make bootstrap-vllm``);
without it they are left out, with a note in the JSON.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.report import previous_variants, spread
from bench.stack_stats import handoff_counters, load_spread, prefill_computed
from launch.stack_process import StackProcess


@dataclass(frozen=True, slots=True)
class Workload:
    streams: int = 8
    start: int = 6000
    step: int = 200
    end: int = 8200
    max_tokens: int = 4
    unit: int = 16
    mamba_block_size: int = 64
    seed: int = 0

    @property
    def lengths(self) -> list[int]:
        return list(range(self.start, self.end + 1, self.step))


QUICK = Workload(streams=4, start=2000, step=200, end=2800, max_tokens=2)


def variants(w: Workload) -> dict[str, list[str]]:
    u, b = str(w.unit), str(w.mamba_block_size)
    common = ["--mamba-block-size", b, "--max-model-len", str(max(16384, w.end + 64))]
    return {
        "partial": ["--prefix-match-unit", u, *common],
        "aligned": ["--prefix-match-unit", b, *common],
        "nocache": ["--prefix-match-unit", u, "--no-enable-prefix-caching", *common],
        "roundrobin": ["--prefix-match-unit", u, "--routing", "round_robin", *common],
        "partial_eagle": ["--prefix-match-unit", u, "--eagle", *common],
        "aligned_eagle": ["--prefix-match-unit", b, "--eagle", *common],
        "vllm-direct": [],  # not our stack: see _run_variant
        "vllm-pd": [],  # not our stack: see _run_variant
        "vllm-partial": ["--engine", "vllm", "--dtype", "bfloat16", "--prefix-match-unit", u, *common],
        ROUTERS_VARIANT: ["--prefix-match-unit", u, *common],
    }


VLLM_VARIANTS = ("vllm-direct", "vllm-pd", "vllm-partial")
#: ``partial`` served through 4 routers sharing the index and the actors (#30): every
#: request of a stream goes to another router than its previous one
ROUTERS_VARIANT = "partial-4routers"
ROUTERS = 4


def _run_variant(name: str, args: list[str], w: Workload, tmp: Path) -> dict[str, Any]:
    from bench.vllm_direct import VllmServer, vllm_venv
    from bench.vllm_pd import VllmPd

    if name == ROUTERS_VARIANT:
        from bench.routers import attached_routers

        with StackProcess(tmp, args) as st, attached_routers(st, ROUTERS, args, tmp) as urls:
            return run_workload(urls, w, name)
    if name not in VLLM_VARIANTS:
        with StackProcess(tmp, args) as st:
            return run_workload(st.http, w, name)
    venv = vllm_venv()
    if venv is None:
        raise FileNotFoundError("no vLLM environment (make bootstrap-vllm)")
    if name == "vllm-direct":
        with VllmServer(venv, tmp, w.unit, max(16384, w.end + 64)) as srv:
            return run_workload(srv.http, w, name)
    if name == "vllm-pd":
        with VllmPd(venv, tmp, w.unit, max(16384, w.end + 64)) as pd:
            return {**run_workload(pd.http, w, name), "server": pd.describe()}
    with StackProcess(
        tmp, [*args, "--max-num-batched-tokens", str(max(16384, w.end + 64))], 900, venv / "bin" / "hybridpd"
    ) as st:
        return run_workload(st.http, w, name)


def _run_in_tmp(name: str, args: list[str], w: Workload) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hybridpd-bench-") as tmp:
        return _run_variant(name, args, w, Path(tmp))


_LOCAL = threading.local()


def _client() -> httpx.Client:
    """One keep-alive client per thread, as serving clients have (a fresh
    ``httpx.Client`` per request alone adds ~20 ms to every TTFT here)."""
    if not hasattr(_LOCAL, "client"):
        _LOCAL.client = httpx.Client()
    return _LOCAL.client


def _one(url: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage = None
    with _client().stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
    assert usage is not None and ttft is not None
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "ttft_s": ttft,
        "latency_s": time.perf_counter() - t0,
    }


def run_workload(url: str | Sequence[str], w: Workload, label: str) -> dict[str, Any]:
    """Round after round, every stream's next prompt, all in flight at once. ``url``:
    one server, or several routers of one stack (round r, stream s: router
    ``(r + s) % n``, so each request goes to another router than its previous one)."""
    urls = [url] if isinstance(url, str) else list(url)
    rng = random.Random(w.seed)
    streams = [[rng.randrange(5, 2048) for _ in range(w.end)] for _ in range(w.streams)]
    rounds: list[list[dict[str, Any]]] = []
    inc_wall = 0.0
    handoffs: list[tuple[int, int] | None] = []  # decode's (read, not read) after round 1 and at the end
    computed: list[dict[str, int] | None] = []  # each prefill instance's computed tokens, at the same times
    with concurrent.futures.ThreadPoolExecutor(w.streams) as pool:
        for r, n in enumerate(tqdm(w.lengths, desc="%s rounds" % label, unit="round")):
            t0 = time.perf_counter()
            prompts = [s[:n] for s in streams]
            sent = [(urls[(r + i) % len(urls)], p) for i, p in enumerate(prompts)]
            rounds.append(list(pool.map(lambda up: _one(up[0], up[1], w.max_tokens), sent)))  # barrier
            if r > 0:
                inc_wall += time.perf_counter() - t0
            if r == 0 or r == len(w.lengths) - 1:
                handoffs.append(handoff_counters(_client(), urls[0]))
                computed.append(prefill_computed(_client(), urls[0]))
    inc = [x for rnd in rounds[1:] for x in rnd]
    cached = statistics.fmean(x["cached_tokens"] for x in inc)
    recomputed = statistics.fmean(x["prompt_tokens"] - x["cached_tokens"] for x in inc)
    ttfts = sorted(x["ttft_s"] * 1e3 for x in inc)
    tokens = sum(x["prompt_tokens"] + x["completion_tokens"] for x in inc)
    first, last = handoffs[0], handoffs[-1]
    read = (last[0] - first[0]) / len(inc) if first and last and inc else None
    whole = (last[0] + last[1] - first[0] - first[1]) / len(inc) if first and last and inc else None
    return {
        # per incremental request: bytes its handoff read over NIXL (delta handoffs: what decode
        # lacked), and what it would have read whole (the prompt's KV, state and draft hidden)
        "handoff_bytes_per_request": read,
        "handoff_full_bytes_per_request": whole,
        "incremental_requests": len(inc),
        "cached_tokens_per_request": cached,
        "recomputed_tokens_per_request": recomputed,
        "ideal_tokens_per_request": float(w.step),
        "recompute_over_ideal": recomputed / w.step,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "throughput_tokens_per_s": tokens / inc_wall if inc_wall else 0.0,
        "cold_ttft_p50_ms": statistics.median(x["ttft_s"] * 1e3 for x in rounds[0]),
        "hit_rate": sum(x["cached_tokens"] for x in inc) / sum(x["prompt_tokens"] for x in inc),
        "routers": len(urls),
        # how the incremental rounds' prefill work spread over the instances (herding: max_share -> 1)
        "prefill_load": load_spread(computed[0], computed[-1]),
    }


def _ratios(v: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    def div(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "recomputed_tokens": div(v["recomputed_tokens_per_request"], base["recomputed_tokens_per_request"]),
        "cached_tokens": div(v["cached_tokens_per_request"], base["cached_tokens_per_request"]),
        "ttft_p50": div(v["ttft_p50_ms"], base["ttft_p50_ms"]),
        "throughput": div(v["throughput_tokens_per_s"], base["throughput_tokens_per_s"]),
    }


def _previous(json_path: Path, w: Workload, quick: bool) -> dict[str, Any]:
    """Variants already in ``json_path`` for this same workload, without their ratios (recomputed)."""
    old = previous_variants(json_path, asdict(w), quick)
    return {k: {m: x for m, x in v.items() if not m.startswith("vs_")} for k, v in old.items()}


def run(
    json_path: Path,
    quick: bool,
    url: str | None = None,
    only: list[str] | None = None,
    overrides: dict[str, int] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the variants (all, or ``only`` these: then merged into the same workload's
    earlier results in ``json_path``), each ``repeats`` times interleaved (every
    repeat kept, medians published: bench/repeats.py), and write JSON + PNG +
    markdown. ``overrides`` replace workload fields (``--workload``)."""
    from bench.repeats import measure, measure_variants
    from bench.vllm_direct import vllm_venv

    w = dataclasses.replace(QUICK if quick else Workload(), **(overrides or {}))
    results: dict[str, Any] = {}
    notes: dict[str, str] = {}
    if url is not None:
        results["external"] = measure(lambda: run_workload(url, w, "external"), repeats, "external")
    else:
        fns = {
            name: functools.partial(_run_in_tmp, name, args, w)
            for name, args in variants(w).items()
            if not only or name in only
        }
        venv = vllm_venv()
        results, notes = measure_variants(fns, repeats, {n: venv for n in fns if n in VLLM_VARIANTS})
        if only:
            results = {**_previous(json_path, w, quick), **results}
    for name, v in results.items():
        for base in ("nocache", "aligned", "vllm-direct", "vllm-pd"):
            if base in results and name != base:
                v["vs_" + base] = _ratios(v, results[base])
    checks = {}
    if "partial" in results:
        checks["partial_recompute_over_ideal_max"] = 1.1
        checks["partial_ok"] = results["partial"]["recompute_over_ideal"] <= 1.1
    if "partial_eagle" in results:
        # the native EAGLE head replays no unit (EngineProfile.eagle_drop): its hits are partial's
        checks["partial_eagle_recompute_over_ideal_max"] = 1.07
        checks["partial_eagle_ok"] = results["partial_eagle"]["recompute_over_ideal"] <= 1.07
        if "partial" in results:
            checks["partial_eagle_caches_as_partial"] = (
                results["partial_eagle"]["cached_tokens_per_request"] == results["partial"]["cached_tokens_per_request"]
            )
    if "partial" in results and ROUTERS_VARIANT in results:
        # 4 routers sharing the index hit as much as one (#30: within 2 %)
        ratio = results[ROUTERS_VARIANT]["hit_rate"] / results["partial"]["hit_rate"]
        checks["routers_hit_rate_ratio"] = ratio
        checks["routers_hit_rate_ok"] = ratio >= 0.98
    if "partial" in results and "aligned" in results:
        checks["partial_caches_more_than_aligned"] = (
            results["partial"]["cached_tokens_per_request"] > results["aligned"]["cached_tokens_per_request"]
        )
    out = {"workload": asdict(w), "quick": quick, "variants": results, "checks": checks, "notes": notes}
    _write(json_path, out)
    return out


def _write(path: Path, out: dict[str, Any]) -> None:
    from bench.report import plot_bars, write_json

    write_json(path, out)
    v = out["variants"]
    plot_bars(
        path.with_suffix(".png"),
        {
            "recomputed tokens / incremental request": {k: x["recomputed_tokens_per_request"] for k, x in v.items()},
            "TTFT p50 (ms)": {k: x["ttft_p50_ms"] for k, x in v.items()},
        },
        "growing streams: %s" % json.dumps(out["workload"]),
    )
    path.with_suffix(".md").write_text(markdown(out))


def markdown(out: dict[str, Any]) -> str:
    """The per-variant table of a run's JSON: medians of the repeats, with their
    min-max where they differ (TTFT and throughput vary by the minute here; the
    token counts are the policy's and repeat exactly)."""
    rows = [
        "| variant | repeats | cached / req | recomputed / req | ideal | recomputed / ideal"
        " | TTFT p50 ms | TTFT p90 ms | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, x in out["variants"].items():
        rows.append(
            "| %s | %d | %s | %s | %.0f | %s | %s | %s | %s |"
            % (
                k,
                x.get("repeat_count", 1),
                spread(x, "cached_tokens_per_request"),
                spread(x, "recomputed_tokens_per_request"),
                x["ideal_tokens_per_request"],
                spread(x, "recompute_over_ideal", spec="%.3f"),
                spread(x, "ttft_p50_ms"),
                spread(x, "ttft_p90_ms"),
                spread(x, "throughput_tokens_per_s", spec="%.0f"),
            )
        )
    # the vLLM engine's handoffs move through vLLM's own NixlConnector: our counters see none of them
    handoffs = {k: x for k, x in out["variants"].items() if x.get("handoff_full_bytes_per_request")}
    if handoffs:
        rows += [
            "",
            "| variant | handoff KiB / req (read) | whole prompt KiB / req | read / whole |",
            "|---|---|---|---|",
        ]
        for k, x in handoffs.items():
            read, whole = x["handoff_bytes_per_request"], x["handoff_full_bytes_per_request"]
            rows.append(
                "| %s | %s | %s | %s |"
                % (
                    k,
                    spread(x, "handoff_bytes_per_request", scale=1 / 1024),
                    spread(x, "handoff_full_bytes_per_request", scale=1 / 1024),
                    "%.3f" % (read / whole),
                )
            )
    return "\n".join(rows) + "\n"
