# Over 350 lines: one workload run against every variant (stack, vLLM, vLLM P/D, stack on vLLM).
"""Runs the multi-turn workload (``bench.multi_turn``: the plan and the
arithmetic) against each variant and writes JSON + PNG + markdown
(``hybridpd bench multi-turn``).

Requests go one at a time, streaming (TTFT: the first chunk with a choice);
each user's next request waits until ``think_ms`` after its previous answer
ended. On our stack the router's answer counters (``/metrics``) and the
prefill actors' answer-checkpoint counters (``/v1/hybridpd/stats``) are read
around every request, so each request's deltas are its own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.multi_turn import QUICK, VARIANTS, Plan, TextEncoder, Workload, build_plan, checks, lcp, summarize
from bench.repeats import measure_variants
from bench.report import previous_variants, spread
from bench.stack_stats import handoff_counters
from bench.vllm_direct import vllm_venv

Messages = list[tuple[str, str]]
ChatIds = Callable[[Messages], list[int]]

#: sent before the plan, not recorded (first-request costs out of the first TTFT):
#: no system message, so it shares less than a unit with the plan
WARMUP: Messages = [("user", "Return the warm-up value.")]

_COUNTER = re.compile(r'^(hybridpd_answer_\w+?)_total(?:\{outcome="(\w+)"\})? (\S+)$')
#: the prefill actors' answer-checkpoint counters (``services/prefill/answers.py``)
PREFILL_COUNTERS = (
    "answer_checkpoints",
    "answer_checkpoint_tokens",
    "answer_checkpoint_bytes",
    "answer_checkpoints_dropped",
    "answer_checkpoints_skipped",
    "answer_checkpoints_failed",
    "checkpoint_exports",
    "checkpoint_export_bytes",
    "checkpoint_state_bytes",
    "checkpoint_export_failures",
)


@dataclasses.dataclass(frozen=True)
class Encoders:
    """A server's tokenization: chat messages -> prompt ids, text -> ids; ``stop_ids``
    (stripped from an answer's end before comparing it with its re-tokenized text,
    as the router does) and ``special_ids`` (ids that decode to no text; None: unknown)."""

    chat_ids: ChatIds
    text_ids: TextEncoder
    stop_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] | None = None
    #: messages ending in (assistant answer, user message) -> the prompt's tokens after
    #: the answer's text (template + message + generation prompt), tokenized alone
    suffix_tokens: Callable[[Messages], int] | None = None
    #: ids -> their text (the router's tokenizer; None: unknown)
    decode: Callable[[list[int]], str] | None = None


def native_encoders() -> Encoders:
    """The router's tokenization (the bundled model's assets)."""
    from hybridpd.model_files import TOKENIZER_DIR

    return router_encoders(TOKENIZER_DIR)


def router_encoders(tokenizer_dir: Path) -> Encoders:
    """The router's tokenization of the model whose tokenizer files are in ``tokenizer_dir``."""
    from hybridpd.tokenizer import ChatMessage, TextTokenizer

    tok = TextTokenizer(tokenizer_dir)
    special = frozenset(i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special)

    def suffix_tokens(msgs: Messages) -> int:
        # the template ends a turn with <|im_end|>, a special token: the text after the
        # answer tokenizes the same alone as in the whole prompt
        text = tok.chat_prompt([ChatMessage(r, c) for r, c in msgs]).text
        answer = msgs[-2][1]
        return len(tok.encode(text[text.rfind(answer) + len(answer) :]))

    return Encoders(
        lambda msgs: tok.apply_chat_template([ChatMessage(r, c) for r, c in msgs]),
        tok.encode,
        tuple(tok.stop_token_ids),
        special,
        suffix_tokens,
        tok.decode,
    )


def kept_tokens(ids: list[int], decode: Callable[[list[int]], str], text: str) -> int:
    """How many of an answer's generated ``ids`` the router keeps as the answer:
    the most leading ids whose text is exactly the ``text`` the client got (all of
    them, unless the answer ends inside a character: the router then keeps the ids
    before the cut, ``IncrementalDetokenizer.received``; none where no prefix is).

    >>> kept_tokens([1, 2, 3], lambda ids: "abc"[: len(ids)], "abc")
    3
    >>> kept_tokens([1, 2, 3], lambda ids: ["", "a", "ab", "ab\ufffd"][len(ids)], "ab")
    2
    >>> kept_tokens([1, 2], lambda ids: "x", "y")
    0
    """
    for k in range(len(ids), 0, -1):
        if decode(ids[:k]) == text:
            return k
    return 0


def _send(client: httpx.Client, url: str, msgs: Messages, w: Workload) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": r, "content": c} for r, c in msgs],
        "max_tokens": w.answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft = usage = None
    text: list[str] = []
    ids: list[int] | None = []
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError("chat: %s" % data["error"])
            for ch in data.get("choices") or ():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append((ch.get("delta") or {}).get("content") or "")
                if ids is not None and "token_ids" in ch and ch["token_ids"] is not None:
                    ids.extend(ch["token_ids"])
            usage = data.get("usage") or usage
    assert usage is not None and ttft is not None, "stream without usage or tokens"
    if ids is not None and len(ids) != usage["completion_tokens"]:
        ids = None  # the server does not return token ids
    return {"usage": usage, "ttft_ms": ttft * 1e3, "text": "".join(text), "ids": ids}


def _router_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """``hybridpd_answer_*_total`` from the router's /metrics, keyed ``name[:outcome]``."""
    out: dict[str, float] = {}
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        m = _COUNTER.match(line)
        if m:
            out[m.group(1) + (":" + m.group(2) if m.group(2) else "")] = float(m.group(3))
    return out


def _prefill_counters(client: httpx.Client, url: str) -> dict[str, int]:
    """The prefill actors' answer-checkpoint counters, summed."""
    stats = client.get(url + "/v1/hybridpd/stats", timeout=60).json()
    out = dict.fromkeys(PREFILL_COUNTERS, 0)
    for name, s in stats.items():
        if name.startswith("prefill"):
            for k in PREFILL_COUNTERS:
                out[k] += int(s.get(k, 0))
    return out


def _settled(client: httpx.Client, url: str, requested: float, timeout_s: float = 30.0) -> dict[str, int]:
    """The prefill counters once every requested answer checkpoint is done (or dropped,
    skipped, failed), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = _prefill_counters(client, url)
        if _pending(requested, c) <= 0 or time.monotonic() > deadline:
            return c
        time.sleep(0.2)


def _pending(requested: float, c: dict[str, int]) -> int:
    ended = sum(c[k] for k in ("answer_checkpoints", "answer_checkpoints_dropped", "answer_checkpoints_skipped"))
    return int(requested) - ended - c["answer_checkpoints_failed"]


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> int:
    return int(after.get(key, 0) - before.get(key, 0))


def run_conversations(
    url: str,
    plan: Plan,
    w: Workload,
    enc: Encoders,
    native: bool,
) -> dict[str, Any]:
    """Send the plan's conversations to ``url``, round by round, one request at a
    time; per request its usage, TTFT, whether the answer's text re-tokenizes to
    other ids than were generated (``enc``; trailing stop ids stripped; and again
    with the special ids left out of the generated ones: they decode to no text),
    and on our stack (``native``) the router's answer counters' deltas and the
    answer checkpoints still pending when it was sent."""
    from tqdm import tqdm

    records: list[dict[str, Any]] = []
    history: list[Messages] = [[("system", plan.system)] for _ in range(w.users)]
    last_end = [0.0] * w.users
    round1: list[list[int]] = []
    with httpx.Client() as client:
        _send(client, url, WARMUP, w)
        rc = _router_counters(client, url) if native else {}
        start = _settled(client, url, rc.get("hybridpd_answer_checkpoints_requested", 0)) if native else {}
        bar = tqdm(total=w.users * w.rounds, desc="requests", unit="req")
        for rnd in range(1, w.rounds + 1):
            for user in range(w.users):
                msgs = [*history[user], ("user", plan.messages[user][rnd - 1])]
                time.sleep(max(0.0, last_end[user] + w.think_ms / 1e3 - time.monotonic()))
                before = _router_counters(client, url) if native else {}
                pc = _prefill_counters(client, url) if native else None
                hb = (handoff_counters(client, url) if native else None) or (0, 0)
                res = _send(client, url, msgs, w)
                last_end[user] = time.monotonic()
                after = _router_counters(client, url) if native else {}
                ha = (handoff_counters(client, url) if native else None) or (0, 0)
                u = res["usage"]
                rec: dict[str, Any] = {
                    "user": user + 1,
                    "round": rnd,
                    "prompt_tokens": u["prompt_tokens"],
                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    "completion_tokens": u["completion_tokens"],
                    "ttft_ms": res["ttft_ms"],
                    "prefix_tokens": u.get("hybridpd_prefix_tokens"),
                }
                if rnd == 1:
                    ids = enc.chat_ids(msgs)
                    rec["encoded_prompt_tokens"] = len(ids)
                    rec["shared_tokens"] = max((lcp(ids, q) for q in round1), default=0)
                    round1.append(ids)
                elif enc.suffix_tokens is not None:
                    rec["suffix_tokens"] = enc.suffix_tokens(msgs)
                if res["ids"] is not None:
                    gen = list(res["ids"])
                    while gen and gen[-1] in enc.stop_ids:
                        gen.pop()
                    again = enc.text_ids(res["text"])
                    rec["retokenized_differs"] = again != gen
                    rec["retokenized_tokens"] = len(again)
                    rec["retokenized_common_prefix"] = lcp(again, gen)
                    if enc.special_ids is not None:
                        rec["special_ids_in_answer"] = sum(i in enc.special_ids for i in gen)
                        rec["retokenized_differs_nonspecial"] = again != [i for i in gen if i not in enc.special_ids]
                    rec["answer_ids"] = gen
                    if enc.decode is not None:
                        rec["answer_kept_tokens"] = kept_tokens(list(res["ids"]), enc.decode, res["text"])
                rec["answer_text"] = res["text"]
                if native:
                    rec["metric_answer_hit"] = _delta(after, before, "hybridpd_answer_tokens:hit")
                    rec["metric_answer_recomputed"] = _delta(after, before, "hybridpd_answer_tokens:recomputed")
                    rec["metric_retokenized_same"] = _delta(after, before, "hybridpd_answer_retokenized:same")
                    rec["metric_retokenized_differs"] = _delta(after, before, "hybridpd_answer_retokenized:differs")
                    assert pc is not None
                    rec["answer_checkpoints_pending_at_send"] = _pending(
                        before.get("hybridpd_answer_checkpoints_requested", 0), pc
                    )
                    # what this request's handoff read, and what it would have read whole
                    rec["handoff_bytes"] = ha[0] - hb[0]
                    rec["handoff_full_bytes"] = ha[0] - hb[0] + ha[1] - hb[1]
                records.append(rec)
                history[user] = [*msgs, ("assistant", res["text"])]
                bar.update()
        bar.close()
        out = summarize(records, w.unit)
        if native:
            rc2 = _router_counters(client, url)
            requested = rc2.get("hybridpd_answer_checkpoints_requested", 0)
            end = _settled(client, url, requested)
            out["answer_checkpoints_requested"] = int(requested - rc.get("hybridpd_answer_checkpoints_requested", 0))
            out["prefill_answer_counters"] = {k: end[k] - start[k] for k in PREFILL_COUNTERS}
    out["prompt_tokens_match_round1"] = all(
        r["encoded_prompt_tokens"] == r["prompt_tokens"] for r in records if r["round"] == 1
    )
    return out


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
