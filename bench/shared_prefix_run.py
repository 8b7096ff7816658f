"""Runs the shared-prefix workload (``bench.shared_prefix``: the plan, the ideal,
the summaries) against each variant (``bench.shared_prefix_variants``) and writes
JSON + PNG + markdown (``hybridpd bench shared-prefix``).

Each variant runs on a server of its own, started here and stopped after its
plan: our stack (``hybridpd up``, one router or several), our stack on the
vLLM engine (from the vLLM environment), or vLLM alone (``vllm serve``, vLLM's
own P/D). ``bench.shared_prefix_client`` sends the plan to it and
``bench.shared_prefix_checks`` judges the results; the JSON keeps every repeat.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.repeats import measure_variants
from bench.report import previous_variants, spread
from bench.shared_prefix import COUNTING, KINDS, PHASES, QUICK, Messages, PlannedRequest, Workload, build_plan
from bench.shared_prefix_checks import checks
from bench.shared_prefix_checks import plan_ttft_p50 as plan_ttft_p50  # NOTE: block_renderers.py reads it here
from bench.shared_prefix_client import native_chat_encoder, prefill_instances, run_plan
from bench.shared_prefix_variants import (
    ROUTERS,
    ROUTERS_VARIANT,
    STACK_VLLM_VARIANTS,
    VLLM_VARIANTS,
    variants,
)
from bench.vllm_direct import vllm_venv


def _run_stack_vllm(args: list[str], plan: Sequence[PlannedRequest], w: Workload, tmp: Path) -> dict[str, Any]:
    """``stack-vllm``: ``hybridpd up`` of the vLLM environment with ``args``; chat prompts'
    ids from the router's own tokenizer of the model it serves."""
    from bench.vllm_direct import tiny_model
    from hybridpd.tokenizer import ChatMessage, TextTokenizer
    from launch.stack_process import StackProcess

    venv = vllm_venv()
    if venv is None:
        raise FileNotFoundError("no vLLM environment (make bootstrap-vllm)")
    tok = TextTokenizer(Path(tiny_model(venv)))
    with StackProcess(tmp, args, 900, venv / "bin" / "hybridpd") as st:
        encode = lambda msgs: tok.apply_chat_template([ChatMessage(r, c) for r, c in msgs])  # noqa: E731
        out = run_plan(st.http, plan, w, encode, False, prefill_instances(args))
    out["server"] = "hybridpd up " + " ".join(args)
    return out


def _run_vllm(name: str, plan: Sequence[PlannedRequest], w: Workload, tmp: Path) -> dict[str, Any]:
    """``name`` (``VLLM_VARIANTS``) with its shared-prefix junction option (``vllm serve
    --enable-mamba-shared-prefix-checkpoint``; for vllm-pd on both servers); chat
    prompts' ids from the server's ``/tokenize`` (vllm-pd: the prefill server's)."""
    from bench.vllm_direct import VllmServer
    from bench.vllm_pd import VllmPd

    venv = vllm_venv()
    if venv is None:
        raise FileNotFoundError("no vLLM environment (make bootstrap-vllm)")
    how = "%s(shared_prefix_checkpoint=True)" % ("VllmServer" if name == "vllm-direct" else "VllmPd")
    srv: VllmServer | VllmPd = (
        VllmServer(venv, tmp, w.unit, 4096, shared_prefix_checkpoint=True)
        if name == "vllm-direct"
        else VllmPd(venv, tmp, w.unit, 4096, shared_prefix_checkpoint=True, nixl_progress_thread=name != "vllm-pd")
    )
    with srv:

        def encode(msgs: Messages) -> list[int]:  # vLLM's own chat template and tokenizer
            body = {"model": "tiny", "messages": [{"role": r, "content": c} for r, c in msgs]}
            resp = httpx.post(srv.http + "/tokenize", json={**body, "add_generation_prompt": True}, timeout=60)
            resp.raise_for_status()
            return list(resp.json()["tokens"])

        out = run_plan(srv.http, plan, w, encode, native=False)
    if isinstance(srv, VllmPd):
        out["server"] = srv.describe()
    out["junction_option"] = how + (
        "; vLLM 0.32 enables it only with EAGLE on the Mamba group (KVCacheManager:"
        " coordinator.eagle_group_ids), so with EAGLE off (CPU) it is inert"
    )
    return out


def run(
    json_path: Path,
    quick: bool,
    only: list[str] | None = None,
    overrides: dict[str, int] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the variants (all, or ``only`` these, merged into the same workload's
    earlier results in ``json_path``), each ``repeats`` times interleaved (medians
    published, every repeat kept), and write JSON + PNG + markdown.
    ``overrides`` replace workload fields (``--workload``)."""
    from launch.stack_process import StackProcess

    w = dataclasses.replace(QUICK if quick else Workload(), **(overrides or {}))
    plan = build_plan(w, native_chat_encoder())

    def one(name: str, args: list[str]) -> dict[str, Any]:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="hybridpd-bench-") as tmp:
            if name in VLLM_VARIANTS:
                got = _run_vllm(name, plan, w, Path(tmp))
            elif name in STACK_VLLM_VARIANTS:
                got = _run_stack_vllm(args, plan, w, Path(tmp))
            elif name == ROUTERS_VARIANT:
                from bench.routers import attached_routers

                with StackProcess(Path(tmp), args) as st, attached_routers(st, ROUTERS, args, Path(tmp)) as urls:
                    got = run_plan(urls, plan, w, native_chat_encoder(), True, prefill_instances(args))
            else:
                with StackProcess(Path(tmp), args) as st:
                    got = run_plan(st.http, plan, w, native_chat_encoder(), True, prefill_instances(args))
        return {**got, "wall_s": time.monotonic() - t0}

    fns = {name: functools.partial(one, name, args) for name, args in variants(w).items() if not only or name in only}
    results, notes = measure_variants(
        fns, repeats, {n: vllm_venv() for n in fns if n in (*VLLM_VARIANTS, *STACK_VLLM_VARIANTS)}
    )
    if only:
        results = {**previous_variants(json_path, asdict(w), quick), **results}
    from bench import placement

    replayed = placement.report()  # the placement report (#27): pure, seconds
    out = {
        "workload": asdict(w),
        "quick": quick,
        "counting": COUNTING,
        "variants": results,
        "checks": {**checks(results), **{"placement_" + k: v for k, v in replayed["checks"].items()}},
        "notes": notes,
        "placement": replayed,
    }
    _write(json_path, out)
    return out


def _write(path: Path, out: dict[str, Any]) -> None:
    from bench.report import plot_grouped, write_json

    write_json(path, out)
    v, w = out["variants"], out["workload"]
    phases = _phases(v)
    plot_grouped(
        path.with_suffix(".png"),
        {
            "cached / ideal (counted requests)": {
                k: {p: x["phases"][p]["hit_ratio"] for p in phases if p in x["phases"]} for k, x in v.items()
            },
            "TTFT p50 (ms)": {
                k: {p: x["phases"][p]["ttft_p50_ms"] for p in phases if p in x["phases"]} for k, x in v.items()
            },
        },
        "shared prefix, u = %d, B = %d%s" % (w["unit"], w["mamba_block_size"], " (--quick)" if out["quick"] else ""),
    )
    path.with_suffix(".md").write_text(markdown(out))


def _phases(variants: dict[str, Any]) -> list[str]:
    """The phases some variant of a run has, in plan order (older runs lack the later phases)."""
    every = ["%s_%s" % (ph, k) for ph in PHASES for k in KINDS]
    return [p for p in every if any(p in x["phases"] for x in variants.values())]


def markdown(out: dict[str, Any]) -> str:
    """The per-variant, per-phase table of a run's JSON: medians of the repeats
    (min-max where they differ)."""
    v = out["variants"]
    phases = _phases(v)
    counters = sorted({x["state_bytes_counter"] for x in v.values() if x.get("state_bytes_counter")})
    rows = [
        "| variant | repeats | phase | cached | ideal | cached / ideal | (all requests) | TTFT p50 ms | TTFT p90 ms"
        " | %s B / cached token |" % ("/".join(counters) or "state"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, x in v.items():
        for p in (p for p in phases if p in x["phases"]):
            rows.append(
                "| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |"
                % (
                    k,
                    x.get("repeat_count", 1),
                    p,
                    spread(x, "phases", p, "cached_tokens", spec="%d"),
                    spread(x, "phases", p, "ideal_tokens", spec="%d"),
                    spread(x, "phases", p, "hit_ratio", spec="%.3f"),
                    spread(x, "phases", p, "hit_ratio_all", spec="%.3f"),
                    spread(x, "phases", p, "ttft_p50_ms"),
                    spread(x, "phases", p, "ttft_p90_ms"),
                    spread(x, "phases", p, "state_bytes_per_cached_token", spec="%.0f"),
                )
            )
    if "placement" in out:  # the placement report (bench/placement.py)
        from bench import placement

        rows += [
            "",
            "Placement replay (`bench/placement.py`, at equal state bytes):",
            "",
            placement.markdown(out["placement"]),
        ]
    return "\n".join(rows) + "\n"
