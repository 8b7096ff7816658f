"""vLLM's own benchmark client against our stack: ``hybridpd bench vllm-client``.

    hybridpd bench vllm-client [--quick] [--json bench/results/vllm_client.json]

Runs ``vllm bench serve`` (from the vLLM environment, ``make bootstrap-vllm``)
as an outside user would, against:

* ``stack-native``: ``hybridpd up`` as ``make up`` starts it (native engine,
  the bundled tiny model);
* ``stack-vllm``: ``hybridpd up --engine vllm --model tiny`` (tiny Qwen3-Next);
* ``stack-vllm-1p1d``: the same with one prefill and one decode actor, engine
  for engine what ``vllm-pd`` runs (``checks`` compare the two);
* ``stack-vllm-1p1d-no-placement``: the same with ``--no-vllm-placement``
  (no staged placed checkpoints): what placement costs on these workloads;
* ``vllm-direct``: plain ``vllm serve`` of the same tiny Qwen3-Next (prefix
  caching at the same unit): what the vLLM engine alone gives, model for
  model with ``stack-vllm``;
* ``vllm-pd``: vLLM's own prefill/decode disaggregation of the same model (a
  prefill and a decode ``vllm serve`` with the same flags over NixlConnector,
  and a proxy: bench/vllm_pd.py), with NIXL's progress thread off (the module
  doc of bench/vllm_pd.py says why): what users would run instead of our P/D;
* ``vllm-pd-shipped``: the same with NIXL's settings as vLLM ships them
  (progress thread on).

Every vLLM server gets the KV space our vLLM engine gets by default
(``bench.vllm_direct.KV_CACHE_GIB``).

Workloads: ``random`` (1,024 prompt tokens, 32 output tokens, ``--ignore-eos``)
at concurrency 1 and 4, and ``prefix_repetition`` (4 prefixes of 2,000
tokens, 300-token suffixes, 16 output tokens) at concurrency 4, each with
its own seed (so no run hits the previous run's prompts). The tokenizer is
the tiny models' shared one. Each run's own result JSON is kept
beside the summary (``<json stem>_runs/<target>/<repeat>/``, which git ignores:
the summary keeps every repeat's figures with its provenance).

``--target`` picks some of them (default: all). Targets are run
``--repeats`` times, interleaved, each repeat on a freshly
started target with its own provenance; the summary has every repeat and the
medians (``bench.repeats``). vLLM's client counts ITL per SSE chunk.
"""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.report import write_json
from bench.vllm_direct import VllmServer, tiny_model, vllm_venv
from bench.vllm_pd import VllmPd
from launch.stack_process import StackProcess

WORKLOADS: dict[str, tuple[list[str], int]] = {
    "random_c1": (["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "32"], 1),
    "random_c4": (["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "32"], 4),
    "prefix_repetition_c4": (
        [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "2000",
            "--prefix-repetition-suffix-len",
            "300",
            "--prefix-repetition-num-prefixes",
            "4",
            "--prefix-repetition-output-len",
            "16",
        ],
        4,
    ),
}
#: item 5 of #25: our P/D against vLLM's own, engine for engine, on the random workloads
#: (the medians over the repeats): TTFT p50 and ITL p50 at most these multiples
PD_BUDGETS = {"median_ttft_ms": 1.15, "median_itl_ms": 1.1}
OURS_PD, THEIRS_PD = "stack-vllm-1p1d", ("vllm-pd", "vllm-pd-shipped")
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput", "completed")


def bench_serve(venv: Path, url: str, tokenizer: Path, name: str, prompts: int, out_dir: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run; returns the KEYS of its result JSON."""
    args, concurrency = WORKLOADS[name]
    argv = [
        str(venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(tokenizer),
        *args,
        "--num-prompts",
        str(prompts),
        "--seed",  # a seed per workload: the same prompts again would be prefix-cache hits
        str(1 + list(WORKLOADS).index(name)),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name + ".json",
    ]
    subprocess.run(argv, check=True)
    res = json.loads((out_dir / (name + ".json")).read_text())
    return {k: res.get(k) for k in KEYS}


def ttft_stage_sums(url: str) -> dict[str, tuple[float, float]]:
    """The router's TTFT stages so far (``/metrics``): stage -> (sum s, count); the queue
    (``hybridpd_queue_seconds``) as stage ``queue``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name not in ("hybridpd_ttft_stage_seconds", "hybridpd_queue_seconds"):
            continue
        for s in fam.samples:
            kind = s.name.rpartition("_")[2]
            if kind in ("sum", "count"):
                acc = out.setdefault(s.labels.get("stage", "queue"), [0.0, 0.0])
                acc[kind == "count"] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms per stage over the requests between two :func:`ttft_stage_sums`.

    >>> stage_means({"decode": (1.0, 10)}, {"decode": (1.5, 20), "queue": (0.02, 10)})
    {'decode': 50.0, 'queue': 2.0}
    """
    out = {}
    for stage, (s, n) in sorted(after.items()):
        s0, n0 = before.get(stage, (0.0, 0))
        if n > n0:
            out[stage] = round(1e3 * (s - s0) / (n - n0), 3)
    return out


def pd_checks(variants: dict[str, Any], workloads: list[str]) -> dict[str, Any]:
    """``stack-vllm-1p1d`` against each of ``vllm-pd`` and ``vllm-pd-shipped`` that ran,
    on every random workload, judged on the medians over the repeats (``PD_BUDGETS``);
    empty unless ours and one of them ran. A pair's checks read ``NOT_COMPARABLE``
    unless the two are one run (``bench.provenance.same_run``)."""
    from bench.provenance import judged, variants_same_run

    if OURS_PD not in variants or not any(t in variants for t in THEIRS_PD):
        return {}
    out: dict[str, Any] = {"budgets": dict(PD_BUDGETS)}
    for theirs_name in (t for t in THEIRS_PD if t in variants):
        suffix = theirs_name.replace("-", "_")
        pair: dict[str, Any] = {}
        for name in (w for w in workloads if w.startswith("random")):
            for key, budget in PD_BUDGETS.items():
                ours, theirs = variants[OURS_PD][name].get(key), variants[theirs_name][name].get(key)
                label = "%s_%s_vs_%s" % (name, key.removeprefix("median_").replace("_ms", "_p50"), suffix)
                if not ours or not theirs:
                    pair[label] = None
                    pair[label + "_ok"] = False
                    continue
                pair[label] = round(float(ours) / float(theirs), 3)
                pair[label + "_ok"] = pair[label] <= budget
        out.update(judged(variants_same_run([variants[OURS_PD], variants[theirs_name]]), pair))
    return out


def run(json_path: Path, quick: bool, repeats: int = 3, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """``only``: the targets to run (all when empty)."""
    from bench.repeats import measure_variants

    venv = vllm_venv()
    if venv is None:
        raise FileNotFoundError("no vLLM environment: run `make bootstrap-vllm` first")
    tokenizer = Path(tiny_model(venv))
    prompts = 8 if quick else 32
    raw_dir = json_path.parent / (json_path.stem + "_runs")
    one_p_one_d = [
        *("--engine", "vllm", "--model", "tiny", "--num-prefill", "1", "--num-decode", "1"),
        *("--max-model-len", "4096", "--max-num-batched-tokens", "4096"),
    ]
    with tempfile.TemporaryDirectory(prefix="hybridpd-vllm-client-") as tmp:
        targets: dict[str, Callable[[], StackProcess | VllmServer | VllmPd]] = {
            "stack-native": lambda: StackProcess(Path(tmp) / "native", ["--max-model-len", "4096"]),
            "stack-vllm": lambda: StackProcess(
                Path(tmp) / "vllm",
                ["--engine", "vllm", "--model", "tiny", "--max-model-len", "4096", "--max-num-batched-tokens", "4096"],
                900,
                venv / "bin" / "hybridpd",
            ),
            "stack-vllm-1p1d": lambda: StackProcess(
                Path(tmp) / "vllm-1p1d", one_p_one_d, 900, venv / "bin" / "hybridpd"
            ),
            "stack-vllm-1p1d-no-placement": lambda: StackProcess(
                Path(tmp) / "vllm-1p1d-np", [*one_p_one_d, "--no-vllm-placement"], 900, venv / "bin" / "hybridpd"
            ),
            "vllm-direct": lambda: VllmServer(venv, Path(tmp), 16, 4096),
            "vllm-pd": lambda: VllmPd(venv, Path(tmp), 16, 4096),
            "vllm-pd-shipped": lambda: VllmPd(venv, Path(tmp), 16, 4096, nixl_progress_thread=True),
        }
        unknown = set(only) - set(targets)
        if unknown:
            raise ValueError("unknown target(s) %s (known: %s)" % (sorted(unknown), ", ".join(targets)))
        if only:
            targets = {t: f for t, f in targets.items() if t in only}
        done: dict[str, int] = dict.fromkeys(targets, 0)

        def one(target: str) -> dict[str, Any]:
            done[target] += 1
            out_dir = raw_dir / target / str(done[target])
            out_dir.mkdir(parents=True, exist_ok=True)
            with targets[target]() as srv:
                out: dict[str, Any] = {}
                for name in WORKLOADS:
                    before = ttft_stage_sums(srv.http) if isinstance(srv, StackProcess) else None
                    out[name] = bench_serve(venv, srv.http, tokenizer, name, prompts, out_dir)
                    if before is not None:
                        out[name]["ttft_stage_mean_ms"] = stage_means(before, ttft_stage_sums(srv.http))
                return out

        fns = {t: functools.partial(one, t) for t in targets}
        variants, notes = measure_variants(fns, repeats, dict.fromkeys(targets, venv))
    out = {
        "quick": quick,
        "prompts_per_run": prompts,
        "workloads": list(WORKLOADS),
        "variants": variants,
        "notes": notes,
        "checks": pd_checks(variants, list(WORKLOADS)),
    }
    write_json(json_path, out)
    return out
