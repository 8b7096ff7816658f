"""Bounded soak: many concurrent streams for a fixed time, then accounting.

    hybridpd bench soak [--minutes 10] [--streams 16] [--json PATH] [--url URL]

S client threads send requests back to back until the time is up: token-id
prompts built from a few shared prefixes (256 to 2,048 tokens) plus a suffix
drawn from a small set (so prompts repeat and hit caches), greedy, mixed
``/v1/completions`` streaming / non-streaming and ``/v1/chat/completions``.
Every response is checked: HTTP 200, a finish reason, exactly ``max_tokens``
tokens for ``length`` (at most that for ``stop``: ``ignore_eos`` ignores EOS,
not the chat template's stop token), usage matching the tokens, a stream that ends with ``[DONE]``, and the same
tokens every time the same prompt comes back (caching under load must not
change answers). At the end a sample of the distinct prompts is run again on
a reference: the native engine in this process with prefix caching off, one
request at a time (a plain full-recompute run), and every sampled answer must
equal it token for token (``reference_mismatches``; exact where fp32 matmul
rows are batch-invariant, which ``reference_row_invariant`` records). A
sampler records the RSS of the router and of every actor process, and pool
accounting, every few seconds. At the end it waits for every pool to be back
to all-free and reports RSS growth from the first sample after warm-up to the
last.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from bench import provenance
from launch.stack_process import StackProcess


@dataclass(frozen=True, slots=True)
class SoakConfig:
    minutes: float = 10.0
    streams: int = 16
    prefix_lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    suffixes_per_prefix: int = 24
    max_suffix: int = 300
    max_tokens: tuple[int, ...] = (4, 8, 16, 32)
    sample_every_s: float = 5.0
    seed: int = 0
    #: distinct prompts whose answers are compared with a no-cache run of the same prompt
    reference_sample: int = 32


class _Workload:
    """Deterministic prompts: prefix p, suffix s -> the same tokens every time."""

    def __init__(self, cfg: SoakConfig) -> None:
        rng = random.Random(cfg.seed)
        self.cfg = cfg
        self.prefixes = [[rng.randrange(5, 2048) for _ in range(n)] for n in cfg.prefix_lengths]
        self.suffixes = [
            [
                [rng.randrange(5, 2048) for _ in range(rng.randrange(1, cfg.max_suffix))]
                for _ in range(cfg.suffixes_per_prefix)
            ]
            for _ in cfg.prefix_lengths
        ]

    def draw(self, rng: random.Random) -> tuple[str, dict[str, Any], str]:
        """(key, body, api) of one request; equal keys mean equal prompts and settings."""
        p = rng.randrange(len(self.prefixes))
        s = rng.randrange(self.cfg.suffixes_per_prefix)
        n = self.cfg.max_tokens[(p + s) % len(self.cfg.max_tokens)]
        api = rng.choices(["stream", "plain", "chat"], weights=[6, 3, 1])[0]
        key = "%s/%d/%d" % (api, p, s)
        common = {"model": "tiny", "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if api == "chat":
            text = " ".join("w%d" % t for t in self.prefixes[p][:64] + self.suffixes[p][s][:16])
            return key, {**common, "messages": [{"role": "user", "content": text}]}, api
        body = {**common, "prompt": self.prefixes[p] + self.suffixes[p][s]}
        if api == "stream":
            body.update(stream=True, stream_options={"include_usage": True})
        return key, body, api


def _call(client: httpx.Client, body: dict[str, Any], api: str) -> tuple[list[int], str, dict[str, Any], float]:
    """One request; returns (token ids, finish reason, usage, ttft_s) or raises with what was wrong."""
    t0 = time.perf_counter()
    if api != "stream":
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        r = client.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError("HTTP %d: %s" % (r.status_code, r.text[:200]))
        data = r.json()
        choice = data["choices"][0]
        if not choice.get("finish_reason"):
            raise RuntimeError("no finish_reason")
        return choice["token_ids"], choice["finish_reason"], data["usage"], time.perf_counter() - t0
    ids: list[int] = []
    usage, ttft, done, finish = None, None, False, None
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError("HTTP %d: %s" % (r.status_code, r.read()[:200].decode(errors="replace")))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError("stream error: %s" % data["error"])
            if ttft is None:
                ttft = time.perf_counter() - t0
            for c in data.get("choices", []):
                ids.extend(c.get("token_ids", []))
                finish = c.get("finish_reason") or finish
            usage = data.get("usage") or usage
    if not done or finish is None or usage is None or ttft is None:
        raise RuntimeError("stream ended early (done=%s finish=%s)" % (done, finish))
    return ids, finish, usage, ttft


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = 0
        self.failures: list[str] = []
        self.inconsistent: list[str] = []
        self.answers: dict[str, list[int]] = {}
        self.bodies: dict[str, dict[str, Any]] = {}
        self.ttft_ms: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def record(
        self, key: str, body: dict[str, Any], ids: list[int], finish: str, usage: dict[str, Any], ttft: float
    ) -> None:
        # ignore_eos ignores EOS only: a stop token (e.g. the chat template's end) still ends a request early
        n, want = len(ids), body["max_tokens"]
        ok = usage["completion_tokens"] == n and (n == want if finish == "length" else finish == "stop" and n <= want)
        with self.lock:
            if not ok:
                self.failures.append(
                    "%s: %d tokens (usage %d), finish %s, max_tokens %d"
                    % (key, n, usage["completion_tokens"], finish, want)
                )
                return
            first = self.answers.setdefault(key, ids)
            self.bodies.setdefault(key, body)
            if first != ids:
                self.inconsistent.append(key)
            self.ok += 1
            self.ttft_ms.append(ttft * 1e3)
            self.prompt_tokens += usage["prompt_tokens"]
            self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            self.completion_tokens += usage["completion_tokens"]


def reference_check(rec: _Recorder, cfg: SoakConfig, model: str = "tiny") -> dict[str, Any]:
    """Run a seeded sample of the distinct prompts on the native engine in this
    process with prefix caching off, one at a time (EAGLE off: its output equals
    plain decoding), and compare each with the first answer the stack gave."""
    import torch

    from hybridpd.config import load_config
    from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
    from hybridpd.engine.native.engine import NativeEngine
    from hybridpd.engine.native.ops import row_invariance_problem
    from hybridpd.models.bundled import resolve_model_dir
    from hybridpd.tokenizer import ChatMessage, TextTokenizer

    keys = sorted(rec.answers)
    sample = sorted(random.Random(cfg.seed).sample(keys, min(cfg.reference_sample, len(keys))))
    engine = NativeEngine(
        load_config(env={}, overrides={"model": model, "enable_prefix_caching": False}), resolve_model_dir(model)
    )
    tok = TextTokenizer(resolve_model_dir(model))
    mismatches = []
    try:
        for i, key in enumerate(tqdm(sample, desc="no-cache reference", unit="prompt")):
            body = rec.bodies[key]
            if "messages" in body:
                prompt = tok.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in body["messages"]])
            else:
                prompt = list(body["prompt"])
            sp = SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True)
            rid = RequestId("soak-ref-%d" % i)
            want = engine.generate([EngineRequest(rid, tuple(prompt), sp)])[rid]
            if want != rec.answers[key]:
                mismatches.append(key)
    finally:
        engine.close()
    problem = row_invariance_problem(torch.float32)
    return {
        "reference": "native engine in-process, prefix caching off, one request at a time",
        "reference_sampled": len(sample),
        "reference_mismatches": len(mismatches),
        "reference_mismatched_keys": mismatches[:20],
        "reference_row_invariant": problem is None,
        "reference_row_invariance_problem": problem,
    }


def _processes(url: str, router_pid: int | None) -> dict[str, int]:
    stats = httpx.get(url + "/v1/hybridpd/stats", timeout=30).json()
    pids = {name: s["pid"] for name, s in stats.items()}
    if router_pid is not None:
        pids["router"] = router_pid
    return pids


def _sample(url: str, pids: dict[str, int]) -> dict[str, Any]:
    rss = {}
    for name, pid in pids.items():
        try:
            rss[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            rss[name] = float("nan")
    stats = httpx.get(url + "/v1/hybridpd/stats", timeout=30).json()
    pools = {name: s["pool"] for name, s in stats.items()}
    return {"t_s": time.monotonic(), "rss_mb": rss, "pools": pools}


def _all_free(pools: dict[str, dict[str, int]]) -> bool:
    return all(
        p["num_free_blocks"] == p["num_blocks"]
        and p["num_free_state_slots"] == p["num_state_slots"]
        and p["num_running"] == 0
        and p["num_waiting"] == 0
        for p in pools.values()
    )


def run_soak(url: str, cfg: SoakConfig, router_pid: int | None = None, reference: bool = True) -> dict[str, Any]:
    """Soak a running stack at ``url`` (serving the bundled ``tiny`` model on the
    defaults when ``reference``); returns the JSON-ready result."""
    work = _Workload(cfg)
    rec = _Recorder()
    pids = _processes(url, router_pid)
    baseline = _sample(url, pids)
    samples = [baseline]
    duration = cfg.minutes * 60
    t_start = time.monotonic()
    stop = threading.Event()

    def client_loop(i: int) -> None:
        rng = random.Random(cfg.seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=600) as client:
            while not stop.is_set():
                key, body, api = work.draw(rng)
                try:
                    ids, finish, usage, ttft = _call(client, body, api)
                except Exception as exc:  # every failure is counted and reported, none stops the soak
                    with rec.lock:
                        rec.failures.append("%s: %s" % (key, exc))
                    continue
                rec.record(key, body, ids, finish, usage, ttft)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(cfg.streams)]
    for t in threads:
        t.start()
    with tqdm(total=int(duration), desc="soak", unit="s") as bar:
        while (elapsed := time.monotonic() - t_start) < duration:
            time.sleep(min(cfg.sample_every_s, max(0.0, duration - elapsed)))
            samples.append(_sample(url, pids))
            bar.n = min(int(time.monotonic() - t_start), int(duration))
            bar.set_postfix(ok=rec.ok, failed=len(rec.failures), refresh=False)
            bar.refresh()
    stop.set()
    for t in threads:
        t.join(660)
    wall = time.monotonic() - t_start
    deadline = time.monotonic() + 60
    end = _sample(url, pids)
    while not _all_free(end["pools"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        end = _sample(url, pids)
    samples.append(end)
    warm = next((s for s in samples if s["t_s"] - t_start >= min(60.0, duration / 4)), samples[-1])
    growth = {name: end["rss_mb"][name] - warm["rss_mb"][name] for name in pids}
    ttft = sorted(rec.ttft_ms) or [float("nan")]
    return {
        "config": asdict(cfg),
        "wall_s": wall,
        "requests_ok": rec.ok,
        "requests_failed": len(rec.failures),
        "failures": rec.failures[:20],
        "inconsistent_outputs": len(rec.inconsistent),
        "distinct_prompts": len(rec.answers),
        "requests_per_s": rec.ok / wall,
        "tokens_per_s": (rec.prompt_tokens + rec.completion_tokens) / wall,
        "cached_token_fraction": rec.cached_tokens / rec.prompt_tokens if rec.prompt_tokens else 0.0,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "pools_back_to_baseline": _all_free(end["pools"]),
        "pools_end": end["pools"],
        "rss_mb_start": baseline["rss_mb"],
        "rss_mb_after_warmup": warm["rss_mb"],
        "rss_mb_end": end["rss_mb"],
        "rss_growth_mb_after_warmup": growth,
        "samples": [{"t_s": s["t_s"] - t_start, "rss_mb": s["rss_mb"]} for s in samples],
        **(reference_check(rec, cfg) if reference else {"reference": None}),
    }


def run(json_path: Path, cfg: SoakConfig, url: str | None = None) -> dict[str, Any]:
    """Soak ``url``, or a stack started for it on the defaults; write JSON + PNG."""
    with provenance.record() as prov:  # one run: the soak is its own repeat
        if url is not None:  # another stack's model and settings are unknown here: no reference run
            out = run_soak(url, cfg, reference=False)
        else:
            with tempfile.TemporaryDirectory(prefix="hybridpd-soak-") as tmp, StackProcess(Path(tmp)) as st:
                assert st.proc is not None
                out = run_soak(st.http, cfg, router_pid=st.proc.pid)
    out["provenance"] = prov.to_dict()
    out["checks"] = checks(out)
    _write(json_path, out)
    return out


def checks(out: dict[str, Any]) -> dict[str, Any]:
    """Each against its reference: no failed request; repeated prompts answered
    alike; the sampled answers equal the no-cache reference run (where one ran);
    every pool back to its all-free baseline."""
    got = {
        "no_failures": out["requests_failed"] == 0,
        "repeats_consistent": out["inconsistent_outputs"] == 0,
        "pools_back_to_baseline": bool(out["pools_back_to_baseline"]),
    }
    if out.get("reference") is not None:
        got["reference_sampled"] = out["reference_sampled"]
        got["equal_to_no_cache_reference"] = out["reference_mismatches"] == 0 and out["reference_sampled"] > 0
    got["ok"] = all(v for k, v in got.items() if isinstance(v, bool))
    return got


def _write(path: Path, out: dict[str, Any]) -> None:
    from bench.report import write_json

    write_json(path, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ts = [s["t_s"] / 60 for s in out["samples"]]
    for name in out["rss_mb_end"]:
        ax.plot(ts, [s["rss_mb"][name] for s in out["samples"]], label=name)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(
        "soak: %d streams, %d ok, %d failed" % (out["config"]["streams"], out["requests_ok"], out["requests_failed"])
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)
