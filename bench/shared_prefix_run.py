# Over 350 lines: one workload run against every variant (stack, vLLM, vLLM P/D, stack on vLLM).
"""Runs the shared-prefix workload (``bench.shared_prefix``: the plan, the ideal,
the summaries) against each variant and writes JSON + PNG + markdown
(``hybridpd bench shared-prefix``).

Requests go one at a time, streaming (TTFT: the first chunk with a choice);
``usage.prompt_tokens_details.cached_tokens`` is the hit. State bytes come from
the prefill actors' counters in ``/v1/hybridpd/stats``, read (settled) after
each phase.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.provenance import judged, variants_same_run
from bench.repeats import measure_variants
from bench.report import previous_variants, spread
from bench.shared_prefix import (
    COUNTING,
    KINDS,
    PHASES,
    QUICK,
    ChatEncoder,
    Messages,
    PlannedRequest,
    Workload,
    build_plan,
    ideal_tokens,
    summarize,
)
from bench.stack_stats import load_spread, prefill_cache, prefill_computed
from bench.vllm_direct import vllm_venv


def native_chat_encoder() -> ChatEncoder:
    """The router's tokenization of chat messages (the bundled model's assets)."""
    from hybridpd.model_files import TOKENIZER_DIR
    from hybridpd.tokenizer import ChatMessage, TextTokenizer

    tok = TextTokenizer(TOKENIZER_DIR)
    return lambda msgs: tok.apply_chat_template([ChatMessage(r, c) for r, c in msgs])


def _send(
    client: httpx.Client, url: str, r: PlannedRequest, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        **(extra or {}),
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if r.chat:
        body["messages"] = [{"role": role, "content": c} for role, c in r.messages]
    else:
        body["prompt"] = list(r.tokens)
    t0 = time.perf_counter()
    ttft = usage = None
    path = "/v1/chat/completions" if r.chat else "/v1/completions"
    with client.stream("POST", url + path, json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError("%s %s: %s" % (path, r.label, data["error"]))
            if ttft is None and data.get("choices"):
                ttft = time.perf_counter() - t0
            usage = data.get("usage") or usage
    assert usage is not None and ttft is not None, "stream without usage or tokens"
    return {"usage": usage, "ttft_ms": ttft * 1e3}


def _state_counter(url: str) -> tuple[str | None, int]:
    """The prefill actors' state bytes written to the store, summed: the
    ``checkpoint_state_bytes`` counter, else ``checkpoint_export_bytes`` (KV included)."""
    try:
        stats = httpx.get(url + "/v1/hybridpd/stats", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return None, 0
    prefill = [s for name, s in stats.items() if name.startswith("prefill")]
    for key in ("checkpoint_state_bytes", "checkpoint_export_bytes"):
        if prefill and all(key in s for s in prefill):
            return key, sum(int(s[key]) for s in prefill)
    return None, 0


def _settled_counter(url: str) -> tuple[str | None, int]:
    """The counter once exports in flight have landed (unchanged for 0.5 s; at most 10 s)."""
    key, last = _state_counter(url)
    deadline = time.monotonic() + 10
    while key is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        now = _state_counter(url)[1]
        if now == last:
            break
        last = now
    return key, last


#: sent before the plan, not recorded: a token-id prompt (ids the plan's random
#: prompts share at most by chance, never a unit) and a chat prompt with no system message
WARMUP = (
    PlannedRequest("warmup", "ids", tokens=tuple(range(2047, 2047 - 40, -1))),
    PlannedRequest("warmup", "chat", messages=(("user", "Return the warm-up value."),)),
)
#: then, to every prefill engine, token-id prompts of the plan's sizes (random ids: they
#: share no unit with the plan or with another engine's), so that the first measured
#: requests pay no first-use costs (first kernels at a size, first NIXL transfer from
#: each prefill instance). By hand on stack-vllm after WARMUP alone: the first
#: 180-token prompts to each of its two prefill instances took 103-152 ms, later ones
#: 62-88 ms; an engine that gets more of the plan warms sooner, so without this a
#: stack with more engines paid more first-use costs inside the measured phases
WARMUP_LENGTHS = (96, 192, 320, 560)


def warmup_requests(engine: int) -> list[PlannedRequest]:
    """The sized warm-up prompts for the ``engine``-th prefill engine (its own ids)."""
    import random

    rng = random.Random(7919 + engine)
    return [
        PlannedRequest("warmup", "ids", tokens=tuple(rng.randrange(16, 2000) for _ in range(n))) for n in WARMUP_LENGTHS
    ]


def prefill_instances(args: Sequence[str]) -> tuple[str | None, ...]:
    """The prefill instances a stack started with ``args`` runs (``--num-prefill``, else
    the config's default), by the names a request pins (``hybridpd_prefill_instance``)."""
    from hybridpd.config import HybridPDConfig

    n = int(args[list(args).index("--num-prefill") + 1]) if "--num-prefill" in args else None
    count = n if n is not None else int(HybridPDConfig.model_fields["num_prefill"].default)
    return tuple("prefill-%d" % i for i in range(count))


def warm_up(client: httpx.Client, url: str, w: Workload, instances: Sequence[str | None]) -> list[float]:
    """Send ``WARMUP``, then ``warmup_requests`` to each of ``instances`` (pinned; None:
    a server with one prefill engine, unpinned). Returns their TTFTs (ms), for the JSON:
    first-use costs are reported, not hidden."""
    got = [_send(client, url, warm, w.max_tokens)["ttft_ms"] for warm in WARMUP]
    for i, instance in enumerate(instances):
        pin = {"hybridpd_prefill_instance": instance} if instance is not None else {}
        got += [_send(client, url, warm, w.max_tokens, pin)["ttft_ms"] for warm in warmup_requests(i)]
    return [round(t, 2) for t in got]


def run_plan(
    url: str | Sequence[str],
    plan: Sequence[PlannedRequest],
    w: Workload,
    encode: ChatEncoder,
    native: bool,
    instances: Sequence[str | None] = (None,),
) -> dict[str, Any]:
    """Warm up (``warm_up`` with ``instances``: a stack's prefill instances, None for a
    server with one prefill engine), then send ``plan`` to ``url`` one request at a time (several routers of one stack:
    request i to router ``i % n``, so consecutive requests never share one); ``encode`` gives the chat
    prompts' token ids (checked against ``usage.prompt_tokens``). ``native`` (our
    stack): read the state-bytes counter from ``/v1/hybridpd/stats`` after each
    phase, and record per request the tail checkpoint its prefill could leave
    (``checkpoints.planned_checkpoint`` of ``[cached, N)``; None: the protocol's
    rules forbid it, so a later request cannot hit the prompt's end)."""
    from tqdm import tqdm

    from hybridpd.checkpoints import planned_checkpoint
    from hybridpd.config import HybridPDConfig

    align = HybridPDConfig.model_fields["checkpoint_alignment"].default

    urls = [url] if isinstance(url, str) else list(url)
    url = urls[0]
    prompts = [encode(r.messages) if r.chat else list(r.tokens) for r in plan]
    ideals = ideal_tokens(prompts, w.unit)
    records: list[dict[str, Any]] = []
    state_bytes: dict[str, int] = {}
    with httpx.Client() as client:
        warmup = warm_up(client, url, w, instances)  # first-use costs out of the measured TTFTs
        counter, before = _settled_counter(url) if native else (None, 0)
        computed = prefill_computed(client, url)
        for i, r in enumerate(tqdm(plan, desc="requests", unit="req")):
            res = _send(client, urls[i % len(urls)], r, w.max_tokens)
            u = res["usage"]
            records.append(
                {
                    "phase": r.phase,
                    "label": r.label,
                    "counted": r.counted,
                    "prompt_tokens": len(prompts[i]),
                    "reported_prompt_tokens": u["prompt_tokens"],
                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    "ideal_tokens": ideals[i],
                    "ttft_ms": res["ttft_ms"],
                    "prefix_tokens": u.get("hybridpd_prefix_tokens"),
                }
            )
            if native:
                n, hit = len(prompts[i]), records[-1]["cached_tokens"]
                records[-1]["tail_checkpoint"] = planned_checkpoint(hit, n, n, w.unit, w.mamba_block_size, align, False)
            if counter is not None and (i + 1 == len(plan) or plan[i + 1].phase != r.phase):
                after = _settled_counter(url)[1]
                state_bytes[r.phase], before = after - before, after
        load = load_spread(computed, prefill_computed(client, url))
        held = prefill_cache(client, url)
    cached, ideal = sum(x["cached_tokens"] for x in records), sum(x["ideal_tokens"] for x in records)
    return {
        "phases": summarize(records, state_bytes if counter else None),
        "hit_ratio_all_phases": cached / ideal if ideal else float("nan"),
        "routers": len(urls),
        "prefill_load": load,
        "prefill_cache": held,
        "state_bytes_counter": counter,
        "prompt_tokens_match": all(x["prompt_tokens"] == x["reported_prompt_tokens"] for x in records),
        "warmup_ttft_ms": warmup,
        "requests": records,
    }


#: ``branch-aware`` through 4 routers sharing the index and the actors (#30)
ROUTERS_VARIANT = "branch-aware-4routers"
ROUTERS = 4
#: the variants that are vLLM alone, not our stack (see ``_run_vllm``): plain ``vllm
#: serve`` and vLLM's own prefill/decode disaggregation (bench/vllm_pd.py)
VLLM_VARIANTS = ("vllm-direct", "vllm-pd", "vllm-pd-shipped")
#: vLLM's own P/D as measured against: with NIXL's progress thread off (``vllm-pd``,
#: bench/vllm_pd.py says why) and as vLLM ships it (``vllm-pd-shipped``)
PD_BASELINES = ("vllm-pd", "vllm-pd-shipped")
#: stack-vllm with vLLM's ``prefix_cache_retention_interval`` at its scheduler block (640
#: tokens for the tiny model under STACK_VLLM_ARGS, as vLLM reports when the interval is
#: not a multiple of it; at or below the block vLLM keeps every chunk end's state: dense)
#: against stack-vllm's 0: the hit-rate/memory trade-off of #26
STACK_VLLM_DENSE = "stack-vllm-retain-dense"
TINY_SCHEDULER_BLOCK = 640
#: our stack on the vLLM engine (``hybridpd up --engine vllm``, 2 prefill + 1 decode,
#: branch-aware: router-chosen checkpoints as vLLM prefixes, placement too: ``--vllm-placement``,
#: the default, named so the variant says what it runs),
#: run from the vLLM environment
STACK_VLLM = "stack-vllm"
STACK_VLLM_ARGS = (
    *("--engine", "vllm", "--model", "tiny", "--num-prefill", "2", "--num-decode", "1"),
    *("--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--checkpoint-policy", "branch-aware"),
    "--vllm-placement",
)
#: stack-vllm with one prefill actor: engine for engine what vllm-pd runs (one prefill and
#: one decode engine), to measure what the second prefill engine costs on these cores
STACK_VLLM_1P1D = "stack-vllm-1p1d"
#: stack-vllm without the P/D tail stage (``--no-vllm-tail-stage``): a prompt of k u + 1
#: tokens leaves k u - u, as vllm-pd's does, and spends no engine step on k u
STACK_VLLM_NO_TAIL = "stack-vllm-no-tail-stage"
#: stack-vllm without vLLM's MooncakeStoreConnector (``--no-vllm-store``): what the store's
#: lookups and puts cost the plan's TTFT where they share the compute cores
STACK_VLLM_NO_STORE = "stack-vllm-no-store"
#: every variant that is our stack on the vLLM engine (run from the vLLM environment)
STACK_VLLM_VARIANTS = (STACK_VLLM, STACK_VLLM_DENSE, STACK_VLLM_1P1D, STACK_VLLM_NO_TAIL, STACK_VLLM_NO_STORE)


def variants(w: Workload) -> dict[str, list[str]]:
    """``hybridpd up`` flags per variant (vllm-direct, vllm-pd: see ``_run_vllm``). Answer
    checkpoints (issue #17: prefill the model's own answer after a chat turn) are
    off where the config has them: the plan's answers are made up, so no later
    request continues the model's, and their prefills would add store bytes."""
    from hybridpd.config import HybridPDConfig

    common = ["--prefix-match-unit", str(w.unit), "--mamba-block-size", str(w.mamba_block_size)]
    if "answer_checkpoints" in HybridPDConfig.model_fields:
        common.append("--no-answer-checkpoints")
    out = {
        "tail-only": [*common, "--checkpoint-policy", "tail-only"],
        "branch-aware": [*common, "--checkpoint-policy", "branch-aware"],
        "nocache": [*common, "--no-enable-prefix-caching"],
        "vllm-direct": [],
        "vllm-pd": [],
        "vllm-pd-shipped": [],
        ROUTERS_VARIANT: [*common, "--checkpoint-policy", "branch-aware"],
        STACK_VLLM: ["--prefix-match-unit", str(w.unit), *STACK_VLLM_ARGS, *common[4:]],
    }
    out[STACK_VLLM_DENSE] = [*out[STACK_VLLM], "--vllm-retention-interval", str(TINY_SCHEDULER_BLOCK)]
    one = list(out[STACK_VLLM])
    one[one.index("--num-prefill") + 1] = "1"
    out[STACK_VLLM_1P1D] = one
    out[STACK_VLLM_NO_TAIL] = [*out[STACK_VLLM], "--no-vllm-tail-stage"]
    out[STACK_VLLM_NO_STORE] = [*out[STACK_VLLM], "--no-vllm-store"]
    if "checkpoint_placement" in HybridPDConfig.model_fields:  # #27: placement's own effect
        out[PLACEMENT_OFF] = [*common, "--checkpoint-policy", "branch-aware", "--checkpoint-placement", "off"]
        out["tail-only"] += ["--checkpoint-placement", "off"]
    return out


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


#: branch-aware with ``checkpoint_placement: off``: the policy before placement (#27)
PLACEMENT_OFF = "branch-aware-placement-off"
#: #27's done-when: the second request of a two-sharer pair reuses this much of the document
TWO_SHARER_BOUND = 0.75


def _placement_checks(results: dict[str, Any], bound: float) -> dict[str, Any]:
    """#27 on token-id prompts: ``branch-aware`` (placement on) reuses at least
    ``TWO_SHARER_BOUND`` of a prefix two requests share, reaches ``bound`` of the
    fan-out's ideal counted from the second conversation (``hit_ratio_all``: the first
    has an ideal of 0), and is no worse than ``PLACEMENT_OFF`` on any other phase (a
    comparison: ``NOT_COMPARABLE`` unless the two are one run)."""
    ours = results["branch-aware"]["phases"]
    out: dict[str, Any] = {}
    if "twosharer_ids" in ours:
        out["two_sharer_ids_ok"] = ours["twosharer_ids"]["hit_ratio"] >= TWO_SHARER_BOUND
    out["fanout_ids_from_second_ok"] = ours["fanout_ids"]["hit_ratio_all"] >= bound
    if PLACEMENT_OFF in results:
        off = results[PLACEMENT_OFF]["phases"]
        worse = sorted(
            "%s: %.3f vs %.3f" % (p, x["hit_ratio_all"], off[p]["hit_ratio_all"])
            for p, x in ours.items()
            if p in off and x["hit_ratio_all"] < off[p]["hit_ratio_all"]
        )
        same = variants_same_run([results["branch-aware"], results[PLACEMENT_OFF]])
        out.update(judged(same, {"placement_worse_than_off": worse, "placement_no_worse_ok": not worse}))
    return out


#: a hit ratio at the ideal (ratios are rounded sums of whole tokens: 1.0 exactly)
IDEAL_RATIO = 1.0


def _retention_checks(results: dict[str, Any]) -> dict[str, Any]:
    """#26's state budget on vLLM: dense retention (``STACK_VLLM_DENSE``) against
    stack-vllm's 0, as ratios of the hit rate over all phases and of the prefill
    instances' cached pages after the plan (``prefill_cache``); empty without it,
    ``NOT_COMPARABLE`` unless the two are one run."""
    if STACK_VLLM_DENSE not in results or STACK_VLLM not in results:
        return {}
    dense, zero = results[STACK_VLLM_DENSE], results[STACK_VLLM]
    held = [(v.get("prefill_cache") or {}).get("cached_mib") for v in (dense, zero)]
    ratios = {
        "retention_dense_hit_ratio": dense["hit_ratio_all_phases"] / zero["hit_ratio_all_phases"],
        "retention_dense_cached_mib_ratio": held[0] / held[1] if held[0] is not None and held[1] else None,
    }
    return judged(variants_same_run([dense, zero]), ratios)


def plan_ttft_p50(variant: dict[str, Any]) -> float | None:
    """TTFT p50 over every request of the plan (all phases, counted or not), the
    median over the repeats (a single run: its own); None without per-request records."""
    reps = variant.get("repeats") or [variant]
    p50s = [statistics.median(r["ttft_ms"] for r in rep["requests"]) for rep in reps if rep.get("requests")]
    return statistics.median(p50s) if p50s else None


def _ttft_checks(results: dict[str, Any]) -> dict[str, Any]:
    """#25's budgets: ``stack-vllm`` (2 prefill + 1 decode) and, where they ran,
    ``stack-vllm-1p1d`` (engine for engine vllm-pd's two), ``stack-vllm-no-tail-stage``
    and ``stack-vllm-no-store`` against each of ``PD_BASELINES`` that ran: the TTFT p50
    ratio per phase (medians of the repeats) and the phases where ours is not below;
    over the whole plan (``plan_ttft_p50``: the workload's TTFT p50); and the phases
    where ours caches no more (counted requests).
    Each stack's checks read ``NOT_COMPARABLE`` unless it and that baseline are one run."""
    out: dict[str, Any] = {}
    for base in (b for b in PD_BASELINES if b in results):
        pd = results[base]["phases"]
        pd_plan = plan_ttft_p50(results[base])
        vs = base.replace("-", "_")
        for name in (STACK_VLLM, STACK_VLLM_1P1D, STACK_VLLM_NO_TAIL, STACK_VLLM_NO_STORE):
            if name not in results:
                continue
            key = name.replace("-", "_")
            ours = results[name]["phases"]
            one: dict[str, Any] = {}
            one["%s_cached_not_above_%s" % (key, vs)] = sorted(
                p for p, x in ours.items() if p in pd and not x.get("cached_tokens", 0) > pd[p].get("cached_tokens", 0)
            )
            ratios = {p: x["ttft_p50_ms"] / pd[p]["ttft_p50_ms"] for p, x in ours.items() if p in pd}
            one["%s_ttft_p50_vs_%s" % (key, vs)] = {p: round(r, 3) for p, r in ratios.items()}
            one["%s_ttft_not_below_%s" % (key, vs)] = sorted(p for p, r in ratios.items() if not r < 1.0)
            one["%s_ttft_below_%s" % (key, vs)] = not one["%s_ttft_not_below_%s" % (key, vs)]
            plan = plan_ttft_p50(results[name])
            if plan is not None and pd_plan:
                one["%s_plan_ttft_p50_vs_%s" % (key, vs)] = round(plan / pd_plan, 3)
                one["%s_plan_ttft_below_%s" % (key, vs)] = plan < pd_plan
            out.update(judged(variants_same_run([results[name], results[base]]), one))
    return out


def checks(results: dict[str, Any], bound: float = 0.9) -> dict[str, Any]:
    """``branch-aware`` and ``stack-vllm`` at least ``bound`` of the ideal on every
    phase (counted requests); ``stack-vllm`` above ``vllm-direct`` and ``vllm-pd``
    on every phase (``stack_vllm_not_above``: the phases where it is not, with
    both ratios; ``stack_vllm_above_vllm_or_ideal`` also counts a phase where
    stack-vllm is at the ideal, which no variant can be above), from one run
    (``stack_vllm_same_run``, from the provenance); every chat prompt's token count equal to the server's.
    Every check that compares variants reads ``NOT_COMPARABLE`` unless they are one
    run (one clean commit, one machine, one sitting: ``bench.provenance.same_run``)."""
    out: dict[str, Any] = {"prompt_tokens_match": {k: v["prompt_tokens_match"] for k, v in results.items()}}
    if "branch-aware" in results:
        out.update(_placement_checks(results, bound))
    if "branch-aware" in results and ROUTERS_VARIANT in results:
        # 4 routers sharing the index hit as much as one (#30: within 2 %)
        ratio = results[ROUTERS_VARIANT]["hit_ratio_all_phases"] / results["branch-aware"]["hit_ratio_all_phases"]
        same = variants_same_run([results[ROUTERS_VARIANT], results["branch-aware"]])
        out.update(judged(same, {"routers_hit_ratio_ratio": ratio, "routers_hit_ratio_ok": ratio >= 0.98}))
    for name, key in (("branch-aware", "branch_aware"), (STACK_VLLM, "stack_vllm")):
        if name in results:
            ratios = {p: x["hit_ratio"] for p, x in results[name]["phases"].items()}
            out[key + "_hit_ratio_min"] = bound
            out[key + "_ok"] = all(r >= bound for r in ratios.values())
            out[key + "_below"] = sorted(p for p, r in ratios.items() if not r >= bound)
    theirs = [n for n in VLLM_VARIANTS if n in results]
    if STACK_VLLM in results and theirs:
        ours = results[STACK_VLLM]["phases"]
        above: dict[str, Any] = {}
        above["stack_vllm_not_above"] = sorted(
            "%s: %.3f vs %s %.3f" % (p, x["hit_ratio"], n, results[n]["phases"][p]["hit_ratio"])
            for p, x in ours.items()
            for n in theirs
            if not x["hit_ratio"] > results[n]["phases"][p]["hit_ratio"]
        )
        above["stack_vllm_above_vllm"] = not above["stack_vllm_not_above"]
        # where a baseline already reaches the ideal nothing can be above it: at the ideal too counts
        above["stack_vllm_not_above_or_ideal"] = sorted(
            "%s: %.3f vs %s %.3f" % (p, x["hit_ratio"], n, results[n]["phases"][p]["hit_ratio"])
            for p, x in ours.items()
            for n in theirs
            if not (x["hit_ratio"] > results[n]["phases"][p]["hit_ratio"] or x["hit_ratio"] >= IDEAL_RATIO)
        )
        above["stack_vllm_above_vllm_or_ideal"] = not above["stack_vllm_not_above_or_ideal"]
        same = variants_same_run([results[n] for n in (STACK_VLLM, *theirs)])
        out.update(judged(same, above))
        out.update(_retention_checks(results))
        out.update(_ttft_checks(results))
        out["stack_vllm_same_run"] = same
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
