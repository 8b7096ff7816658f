"""What the serving path costs on top of the engine: ``hybridpd bench overhead``.

    hybridpd bench overhead [--quick] [--repeats 3] [--no-integrity] [--json bench/results/overhead.json]

In one run, the same native engine and the same requests (distinct random
token prompts, so no cache hits; greedy; ``ignore_eos``):

* ``engine``: the engine driven in this process (no Ray, no router), with
  as many torch threads as the stack's engines have together (``ENGINE_THREADS``:
  one prefill and one decode actor of ``ACTOR_THREADS`` each), so both sides
  compute on the same resources at every concurrency; TTFT is ``add_request`` to the
  step that returned the first token; each step's output for a request is
  one chunk;
* ``stack``: ``hybridpd up`` with one prefill and one decode actor, driven
  over HTTP (``/v1/completions``, SSE streaming); TTFT is request sent to
  first token received; each SSE event with token ids is one chunk.

Latency per token as the client receives it, the same rule on both sides
(``_timing``): ITL is per token, a k-token chunk counting as ONE gap (since
the previous chunk) followed by k - 1 zero gaps; TPOT is per request,
(last token's time - first token's time) / (tokens - 1); p50 and p99 of the
ITLs pooled over requests and of the requests' TPOTs. Only the stack sends
multi-token chunks (decode merges the outputs already waiting), so its ITL
p50 can sit at a gap its chunking hides; ``tokens_per_chunk`` says how much
merging there was. vLLM's own benchmark client (``vllm bench serve``,
``vllm/benchmarks/lib/endpoint_request_func.py``, 0.32) counts the same TPOT
(its ``latency`` is the last token chunk's time, ``(latency - ttft) /
(output_len - 1)`` in ``benchmarks/serve.py``) but appends one ITL per SSE
chunk and no zeros for a chunk's extra tokens; that per-chunk ITL is
reported too (``itl_chunk_ms``), not budgeted.

Both at concurrency 1 and 4, with output throughput. The two sides
alternate, request batch by request batch (and which goes first), so a load
spike from another process hits both. The stack and the engine start once
and are warmed up; each of ``--repeats`` repeats is the whole schedule on
prompts no earlier repeat sent, with its own provenance (bench/repeats.py:
every repeat kept; the top-level fields are medians with ``min`` / ``max``).
With ``--integrity`` (default) the keyed work per handoff, token frame and store
checkpoint is timed on the same workload, with and without the key, and set
against the stack's TTFT (``integrity``: bench/integrity_cost.py).

Budgets (``checks``, judged on the median over repeats of each repeat's
value, with how many repeats met it; a miss is a false ``met``): issue #18's
stack TTFT p50 at most the engine's + 25 ms at concurrency 1 and stack ITL
p50 at most 1.3x the engine's at concurrency 1 and 4, and stack TPOT p50 at
most 1.3x the engine's at concurrency 1 and 4. ``markdown(out)`` renders the
README table from the JSON.
"""

from __future__ import annotations

import concurrent.futures
import itertools
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

from bench import integrity_cost
from bench import repeats as repeats_mod
from bench.report import spread, write_report
from bench.router import budget_check, checks_markdown, legacy_note, repeats_phrase
from launch.stack_process import StackProcess

#: torch threads in an actor: Ray gives an actor with num_cpus=0 OMP_NUM_THREADS=1
ACTOR_THREADS = 1
#: the stack's engines: one prefill and one decode actor
STACK_ENGINES = 2
#: the engine side's torch threads: the stack's engines' together (equal resources)
ENGINE_THREADS = ACTOR_THREADS * STACK_ENGINES
TTFT_BUDGET_MS = 25.0
ITL_RATIO_BUDGET = 1.3
TPOT_RATIO_BUDGET = 1.3
LEVELS = (1, 4)
#: each check's budget (``value <= budget``; the values: ``check_values``)
BUDGETS = {
    "ttft_p50_c1_over_engine_ms": TTFT_BUDGET_MS,
    **{"itl_p50_ratio_c%d" % c: ITL_RATIO_BUDGET for c in LEVELS},
    **{"tpot_p50_ratio_c%d" % c: TPOT_RATIO_BUDGET for c in LEVELS},
}


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
        from hybridpd.models.bundled import resolve_model_dir

        torch.set_num_threads(ENGINE_THREADS)
        cfg = load_config(overrides={"max_model_len": max_model_len, "model": model})
        self.engine = NativeEngine(cfg, resolve_model_dir(cfg.model))
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
        chunks: dict[str, list[tuple[float, int]]] = {r: [] for r in rids}
        while self.engine.has_work():
            for o in self.engine.step():
                chunks[o.request_id].append((time.perf_counter(), len(o.new_token_ids)))
        return [_timing(t0, chunks[r]) for r in rids]


def _timing(t0: float, chunks: list[tuple[float, int]]) -> dict[str, Any]:
    """TTFT, per-token ITLs and TPOT of one request from its chunks, ``(arrival time, tokens)``.

    A k-token chunk is ONE gap (from the previous chunk) followed by k - 1 zero
    gaps; the first chunk's k - 1 extra tokens are zero gaps after the TTFT.
    TPOT = (last token's time - first token's time) / (tokens - 1). ``chunk_gaps_s``:
    vLLM's client's ITLs, one per chunk after the first."""
    chunks = [(t, k) for t, k in chunks if k > 0]
    itl: list[float] = [0.0] * (chunks[0][1] - 1)
    gaps = [now - prev for (prev, _), (now, _) in itertools.pairwise(chunks)]
    for gap, (_, k) in zip(gaps, chunks[1:], strict=True):
        itl += [gap] + [0.0] * (k - 1)
    tokens = sum(k for _, k in chunks)
    first, last = chunks[0][0], chunks[-1][0]
    return {
        "ttft_s": first - t0,
        "itl_s": itl,
        "chunk_gaps_s": gaps,
        "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None,
        "tokens": tokens,
        "chunks": len(chunks),
        "end": last,
    }


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
    chunks: list[tuple[float, int]] = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            chunks.append((now, len(ids)))
    got = sum(k for _, k in chunks)
    if got != max_tokens:
        raise RuntimeError("stream returned %d tokens, wanted %d" % (got, max_tokens))
    return _timing(t0, chunks)


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
    tpot = [r["tpot_s"] * 1e3 for r in rows if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in rows)
    return {
        "request_count": len(rows),
        "ttft_ms": _pcts(ttft),
        "itl_ms": _pcts(itl),
        "tpot_ms": _pcts(tpot),
        "itl_chunk_ms": _pcts([x * 1e3 for r in rows for x in r["chunk_gaps_s"]]),
        "tokens_per_chunk": tokens / sum(r["chunks"] for r in rows),
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def check_values(results: dict[str, dict[str, dict[str, Any]]], levels: tuple[int, ...] = LEVELS) -> dict[str, float]:
    """One repeat's values of the budgets (``BUDGETS``): stack minus engine TTFT p50 at
    concurrency 1, stack / engine ITL p50 and TPOT p50 at each level."""
    e1, s1 = results["engine"]["concurrency_1"], results["stack"]["concurrency_1"]
    out = {"ttft_p50_c1_over_engine_ms": s1["ttft_ms"]["p50"] - e1["ttft_ms"]["p50"]}
    for c in levels:
        e, s = results["engine"]["concurrency_%d" % c], results["stack"]["concurrency_%d" % c]
        out["itl_p50_ratio_c%d" % c] = _ratio(s["itl_ms"]["p50"], e["itl_ms"]["p50"])
        out["tpot_p50_ratio_c%d" % c] = _ratio(s["tpot_ms"]["p50"], e["tpot_ms"]["p50"])
    return out


def run(
    json_path: Path,
    quick: bool,
    prompt_tokens: int = 1024,
    output_tokens: int = 32,
    model: str = "tiny",
    repeats: int = 3,
    integrity: bool = True,
) -> dict[str, Any]:
    """Start the stack and the engine once, warm both up, measure ``repeats`` times
    (each the whole schedule on fresh prompts), write JSON + PNG + markdown; with
    ``integrity`` also what keyed integrity costs (``bench/integrity_cost.py``)."""
    batches = 4 if quick else 12  # batches per concurrency level and side, per repeat
    max_len = prompt_tokens + output_tokens + 64
    engine = EngineSide(max_len, model)
    with tempfile.TemporaryDirectory(prefix="hybridpd-overhead-") as tmp:
        args = ["--num-prefill", "1", "--num-decode", "1", "--max-model-len", str(max_len), "--model", model]
        with StackProcess(Path(tmp), args) as st:
            sides: dict[str, EngineSide | StackSide] = {
                "engine": engine,
                "stack": StackSide(st.http, model, max(LEVELS)),
            }
            # warm-up at the highest concurrency: first requests pay lazy initialisation
            # (engine buffers, client threads and their connections) on both sides
            for side in sides.values():
                side.batch(_prompts(max(LEVELS), prompt_tokens, -1), output_tokens)
            count = iter(range(repeats))
            measured = repeats_mod.measure(
                lambda: _repeat(sides, next(count), batches, prompt_tokens, output_tokens), repeats, "overhead"
            )
    values = [r["check_values"] for r in measured["repeats"]]
    out = {
        "workload": {
            "model": model,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "batches_per_level": batches,
            "concurrency": list(LEVELS),
            "actor_torch_threads": ACTOR_THREADS,
            "stack_engine_threads": ACTOR_THREADS * STACK_ENGINES,
            "engine_torch_threads": ENGINE_THREADS,
            "cpu_count": os.cpu_count(),
        },
        "quick": quick,
        "budgets": BUDGETS,
        **measured,
        "checks": {k: budget_check([v[k] for v in values], b) for k, b in BUDGETS.items()},
    }
    if integrity:  # after the stack stopped: its NIXL agent must not share the machine's time with it
        cost = integrity_cost.measure(engine.engine, prompt_tokens)
        out["integrity"] = integrity_cost.shares(cost, measured["repeats"])
    e1, s1 = out["results"]["engine"]["concurrency_1"], out["results"]["stack"]["concurrency_1"]
    bars = {
        "engine TTFT": e1["ttft_ms"]["p50"],
        "stack TTFT": s1["ttft_ms"]["p50"],
        "engine TPOTx10": 10 * e1["tpot_ms"]["p50"],
        "stack TPOTx10": 10 * s1["tpot_ms"]["p50"],
    }
    title = "serving-path overhead (median of %d)" % repeats
    write_report(json_path, out, bars, "ms (p50, concurrency 1)", title)
    json_path.with_suffix(".md").write_text(markdown(out))
    return out


def _repeat(
    sides: dict[str, EngineSide | StackSide], rep: int, batches: int, prompt_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """One complete measurement: ``batches`` batches per level and side, the sides
    alternating batch by batch (and which goes first), prompts no earlier repeat sent."""
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {name: {c: [] for c in LEVELS} for name in sides}
    walls: dict[str, dict[int, float]] = {name: dict.fromkeys(LEVELS, 0.0) for name in sides}
    with tqdm(total=batches * len(LEVELS) * len(sides), desc="overhead", unit="batch", leave=False) as bar:
        for c in LEVELS:
            for b in range(batches):
                seed = 10_000 * (rep + 1) + 100 * c + b
                prompts = _prompts(c, prompt_tokens, seed)  # fresh tokens: no cache hits
                order = list(sides.items())
                for name, side in order if b % 2 else order[::-1]:  # alternate which side goes first
                    t0 = time.perf_counter()
                    got = side.batch(prompts, output_tokens)
                    walls[name][c] += time.perf_counter() - t0
                    rows[name][c].extend(got)
                    bar.update(1)
    results = {name: {"concurrency_%d" % c: _summary(rows[name][c], walls[name][c]) for c in LEVELS} for name in rows}
    return {"results": results, "check_values": check_values(results)}


#: how each check is named in the markdown
CHECK_NAMES = {
    "ttft_p50_c1_over_engine_ms": "stack TTFT p50 - engine's, concurrency 1 (ms)",
    "itl_p50_ratio_c1": "stack ITL p50 / engine's, concurrency 1",
    "itl_p50_ratio_c4": "stack ITL p50 / engine's, concurrency 4",
    "tpot_p50_ratio_c1": "stack TPOT p50 / engine's, concurrency 1",
    "tpot_p50_ratio_c4": "stack TPOT p50 / engine's, concurrency 4",
}


def markdown(out: dict[str, Any]) -> str:
    """The README tables of a ``run`` result: medians with the repeats' range, and the checks."""
    legacy = legacy_note(out, "hybridpd bench overhead")
    if legacy:
        return legacy
    w = out["workload"]
    # a file from before the engine side matched the stack: one actor's threads there
    threads = {
        "engine": w.get("engine_torch_threads", w.get("actor_torch_threads", ACTOR_THREADS)),
        "stack": w.get("stack_engine_threads", w.get("actor_torch_threads", ACTOR_THREADS) * STACK_ENGINES),
    }
    rows = [
        "%s of %d batches per concurrency level and side (%s, %d prompt tokens, %d output tokens)."
        % (
            repeats_phrase(out["repeat_count"]),
            w["batches_per_level"],
            w["model"],
            w["prompt_tokens"],
            w["output_tokens"],
        ),
        "ITL per token as received (a k-token chunk: one gap, then k - 1 zeros); TPOT per request.",
        "Torch threads: the engine side %d, the stack's engines %d together (%s)."
        % (threads["engine"], threads["stack"], "equal" if threads["engine"] == threads["stack"] else "**not equal**"),
        "",
        "| side | concurrency | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms"
        " | tokens per chunk | output tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side, levels in out["results"].items():
        for level in levels:

            def f(*path: str, spec: str = "%.2f", side: str = side, level: str = level) -> str:
                return spread(out, "results", side, level, *path, spec=spec)

            rows.append(
                "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"
                % (
                    side,
                    level.removeprefix("concurrency_"),
                    f("ttft_ms", "p50", spec="%.1f"),
                    f("ttft_ms", "p99", spec="%.1f"),
                    f("itl_ms", "p50"),
                    f("itl_ms", "p99"),
                    f("tpot_ms", "p50"),
                    f("tpot_ms", "p99"),
                    f("tokens_per_chunk"),
                    f("output_tokens_per_s", spec="%.1f"),
                )
            )
    rows += ["", *checks_markdown(out["checks"], CHECK_NAMES, "%.2f"), *integrity_cost.markdown(out)]
    return "\n".join(rows) + "\n"
