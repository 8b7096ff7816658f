"""Runs the multi-turn workload (``bench.multi_turn``: the plan and the
arithmetic) against each variant and writes JSON + PNG + markdown
(``hybridpd bench multi-turn``).

Each variant runs on a server of its own, started here and stopped after its
conversations: our stack (``hybridpd up``), our stack on the vLLM engine (from
the vLLM environment), or vLLM alone (``vllm serve``, vLLM's own P/D).
``bench.multi_turn_client`` sends the conversations to it and
``bench.multi_turn_checks`` judges the results; the JSON keeps every repeat.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.multi_turn import QUICK, VARIANTS, Plan, Workload, build_plan
from bench.multi_turn_checks import checks
from bench.multi_turn_client import run_conversations
from bench.multi_turn_encoders import Encoders, Messages, native_encoders, router_encoders
from bench.repeats import measure_variants
from bench.report import previous_variants, spread
from bench.vllm_direct import vllm_venv

#: the variants that are vLLM alone, not our stack (see ``_run_vllm``): plain ``vllm
#: serve`` and vLLM's own prefill/decode disaggregation (bench/vllm_pd.py)
VLLM_VARIANTS = ("vllm-direct", "vllm-pd", "vllm-pd-shipped")
#: our stack on the vLLM engine (2 prefill + 1 decode), with answer checkpoints and
#: without, and with one prefill engine (``stack-vllm-1p1d``: engine for engine what
#: vllm-pd runs, the control for the second prefill engine)
STACK_VLLM = ("stack-vllm", "stack-vllm-prompt-only", "stack-vllm-1p1d")
STACK_VLLM_ARGS = (
    *("--engine", "vllm", "--model", "tiny", "--num-prefill", "2", "--num-decode", "1"),
    *("--max-model-len", "8192", "--max-num-batched-tokens", "8192"),
)
#: the variants in the order the JSON and tables list them
ORDER = (*VARIANTS, *(v for v in (*VLLM_VARIANTS, *STACK_VLLM) if v not in VARIANTS))


def _one_prefill(args: tuple[str, ...]) -> list[str]:
    """``args`` with one prefill actor."""
    out = list(args)
    out[out.index("--num-prefill") + 1] = "1"
    return out


def variants(w: Workload) -> dict[str, list[str]]:
    """``hybridpd up`` flags per variant (vllm-direct, vllm-pd: see ``_run_vllm``)."""
    common = ["--prefix-match-unit", str(w.unit), "--mamba-block-size", str(w.mamba_block_size), "--no-eagle"]
    return {
        "answers-cached": [*common, "--answer-checkpoints"],
        "prompt-only": [*common, "--no-answer-checkpoints"],
        "nocache": [*common, "--no-enable-prefix-caching"],
        "vllm-direct": [],
        "vllm-pd": [],
        "vllm-pd-shipped": [],
        "stack-vllm": [*common[:2], *STACK_VLLM_ARGS, "--answer-checkpoints"],
        "stack-vllm-1p1d": [*common[:2], *_one_prefill(STACK_VLLM_ARGS), "--answer-checkpoints"],
        "stack-vllm-prompt-only": [*common[:2], *STACK_VLLM_ARGS, "--no-answer-checkpoints"],
    }


def _run_stack_vllm(args: list[str], plan: Plan, w: Workload, tmp: Path) -> dict[str, Any]:
    """A ``STACK_VLLM`` variant: ``hybridpd up`` of the vLLM environment with ``args``;
    the router's own tokenization of the model it serves."""
    from bench.vllm_direct import tiny_model
    from launch.stack_process import StackProcess

    venv = vllm_venv()
    if venv is None:
        raise FileNotFoundError("no vLLM environment (make bootstrap-vllm)")
    enc = router_encoders(Path(tiny_model(venv)))
    with StackProcess(tmp, args, 900, venv / "bin" / "hybridpd") as st:
        out = run_conversations(st.http, plan, w, enc, native=True)
    out["server"] = "hybridpd up " + " ".join(args)
    return out


def _run_vllm(name: str, plan: Plan, w: Workload, tmp: Path) -> dict[str, Any]:
    """``name`` (``VLLM_VARIANTS``); the tokenization is the server's ``/tokenize``
    (vllm-pd: the prefill server's)."""
    from bench.vllm_direct import VllmServer
    from bench.vllm_pd import VllmPd

    venv = vllm_venv()
    if venv is None:
        raise FileNotFoundError("no vLLM environment (make bootstrap-vllm)")
    srv: VllmServer | VllmPd = (
        VllmServer(venv, tmp, w.unit, 8192)
        if name == "vllm-direct"
        else VllmPd(venv, tmp, w.unit, 8192, nixl_progress_thread=name != "vllm-pd")
    )
    with srv:

        def tokenize(body: dict[str, Any]) -> list[int]:
            resp = httpx.post(srv.http + "/tokenize", json={"model": "tiny", **body}, timeout=60)
            resp.raise_for_status()
            return list(resp.json()["tokens"])

        def chat_ids(msgs: Messages) -> list[int]:  # vLLM's own chat template and tokenizer
            m = [{"role": r, "content": c} for r, c in msgs]
            return tokenize({"messages": m, "add_generation_prompt": True})

        def text_ids(text: str) -> list[int]:
            return tokenize({"prompt": text, "add_special_tokens": False})

        out = run_conversations(srv.http, plan, w, Encoders(chat_ids, text_ids), native=False)
    out["server"] = (
        srv.describe()
        if isinstance(srv, VllmPd)
        else "vllm serve, prefix caching at unit %d, mamba_cache_mode=align (bench/vllm_direct.py)" % w.unit
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
    enc = native_encoders()
    plan = build_plan(w, enc.text_ids)

    def one(name: str, args: list[str]) -> dict[str, Any]:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="hybridpd-bench-") as tmp:
            if name in VLLM_VARIANTS:
                got = _run_vllm(name, plan, w, Path(tmp))
            elif name in STACK_VLLM:
                got = _run_stack_vllm(args, plan, w, Path(tmp))
            else:
                with StackProcess(Path(tmp), args) as st:
                    got = run_conversations(st.http, plan, w, enc, native=True)
        return {**got, "wall_s": time.monotonic() - t0}

    fns = {name: functools.partial(one, name, args) for name, args in variants(w).items() if not only or name in only}
    results, notes = measure_variants(
        fns, repeats, {n: vllm_venv() for n in fns if n in VLLM_VARIANTS or n in STACK_VLLM}
    )
    if only:
        results = {**previous_variants(json_path, asdict(w), quick), **results}
    results = {k: results[k] for k in ORDER if k in results}
    out = {
        "workload": asdict(w),
        "quick": quick,
        "plan": {"system": plan.system, "messages": plan.messages},
        "variants": results,
        "checks": checks(results, w.unit),
        "notes": notes,
    }
    _write(json_path, out)
    return out


def _write(path: Path, out: dict[str, Any]) -> None:
    from bench.report import plot_grouped, write_json

    write_json(path, out)
    v, w = out["variants"], out["workload"]
    rounds = ["round %d" % (k + 1) for k in range(w["rounds"])]

    def by_round(key: str) -> dict[str, dict[str, float]]:
        return {k: {rounds[y["round"] - 1]: y[key] for y in x["per_round"]} for k, x in v.items()}

    recomputed = by_round("recomputed_tokens_per_request")
    if "answers-cached" in v:
        recomputed["ideal"] = by_round("ideal_tokens_per_request")["answers-cached"]
    plot_grouped(
        path.with_suffix(".png"),
        {"recomputed prompt tokens / request": recomputed, "TTFT p50 (ms)": by_round("ttft_p50_ms")},
        "multi-turn: %d users x %d rounds, answers of %d tokens, u = %d%s"
        % (w["users"], w["rounds"], w["answer_tokens"], w["unit"], " (--quick)" if out["quick"] else ""),
    )
    path.with_suffix(".md").write_text(markdown(out))


def markdown(out: dict[str, Any]) -> str:
    """The overall and per-round tables of a run's JSON: medians of the repeats
    (min-max where they differ)."""
    v = out["variants"]
    rows = [
        "| variant | repeats | recomputed / req | ideal / req | (text) | max over ideal | answer tokens hit | (router) "
        "| retokenized differs (router) | (client) | (no special ids) | TTFT p50 ms | TTFT p90 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, x in v.items():
        rows.append(
            "| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |"
            % (
                k,
                x.get("repeat_count", 1),
                spread(x, "recomputed_tokens_per_request"),
                spread(x, "ideal_tokens_per_request"),
                spread(x, "suffix_tokens_per_request"),
                spread(x, "recomputed_minus_ideal_max", spec="%d"),
                spread(x, "answer_tokens_hit_ratio", spec="%.3f"),
                spread(x, "answer_tokens_hit_ratio_metric", spec="%.3f"),
                spread(x, "retokenized_differs_ratio", spec="%.3f"),
                spread(x, "retokenized_differs_ratio_client", spec="%.3f"),
                spread(x, "retokenized_differs_ratio_nonspecial", spec="%.3f"),
                spread(x, "ttft_p50_ms"),
                spread(x, "ttft_p90_ms"),
            )
        )
    rows += [
        "",
        "| variant | round | recomputed / req | ideal / req | answer tokens hit | TTFT p50 ms | TTFT p90 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, x in v.items():
        for i, y in enumerate(x["per_round"]):
            rows.append(
                "| %s | %d | %s | %s | %s | %s | %s |"
                % (
                    k,
                    y["round"],
                    spread(x, "per_round", i, "recomputed_tokens_per_request"),
                    spread(x, "per_round", i, "ideal_tokens_per_request"),
                    spread(x, "per_round", i, "answer_tokens_hit_ratio", spec="%.3f"),
                    spread(x, "per_round", i, "ttft_p50_ms"),
                    spread(x, "per_round", i, "ttft_p90_ms"),
                )
            )
    handoffs = {k: x for k, x in v.items() if x.get("handoff_bytes_per_request") is not None}
    if handoffs:
        rows += [
            "",
            "Handoff bytes per request (KiB): read over NIXL (delta handoffs), the whole prompt's handoff "
            "(what every handoff read before), and the bound (new tokens + u) x KV bytes per token + state + draft "
            "(rounds >= 2).",
            "",
            "| variant | round | read KiB / req | whole prompt KiB / req | bound KiB / req |",
            "|---|---|---|---|---|",
        ]
        for k, x in handoffs.items():
            for i, y in enumerate(x["per_round"]):
                rows.append(
                    "| %s | %d | %s | %s | %s |"
                    % (
                        k,
                        y["round"],
                        spread(x, "per_round", i, "handoff_bytes_per_request", scale=1 / 1024),
                        spread(x, "per_round", i, "handoff_full_bytes_per_request", scale=1 / 1024),
                        spread(x, "per_round", i, "handoff_bound_bytes_per_request", scale=1 / 1024),
                    )
                )
    return "\n".join(rows) + "\n"
