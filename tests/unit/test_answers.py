"""Answer checkpoints (issue #17), the parts without actors: the answer memory,
the chat prompt that recalls an answer's generated ids, the orchestrator's
decision to make an answer reusable, and the scheduler's background priority."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.engine.native.scheduler import Scheduler
from hybridpd.engine.native.scheduler_config import SchedulerConfig
from hybridpd.engine.native.sequence import Sequence
from hybridpd.models.bundled import resolve_model_dir
from hybridpd.tokenizer import ChatMessage, IncrementalDetokenizer, TextTokenizer
from services.router.answers import AnswerMemory, AnswerPlan, strip_stop
from services.router.metrics import RouterMetrics
from services.router.orchestrator import Orchestrator
from tests.unit.fake_actors import PROMPT, FakeDecode, FakePrefill, clients

pytestmark = pytest.mark.unit

TOK = TextTokenizer(resolve_model_dir("tiny"))
SYSTEM = "You are terse."


# -- the memory -----------------------------------------------------------------------------
def _got(entry: Any) -> Any:
    return None if entry is None else (tuple(entry[0]), entry[1])


def test_memory_is_per_salt_and_bounded() -> None:
    mem = AnswerMemory(max_entries=3, max_tokens=10)
    mem.remember(None, "a", [1, 2], 1)
    mem.remember("tenant-b", "a", [3, 4], 1)
    assert _got(mem.recall(None, "a")) == ((1, 2), 1)
    assert _got(mem.recall("tenant-b", "a")) == ((3, 4), 1)
    assert mem.recall("tenant-c", "a") is None and mem.recall("", "a") is None
    mem.remember(None, "b", [5] * 7, 2)  # 11 tokens in all: the least recently used goes
    assert mem.recall(None, "a") is None and mem.recall(None, "b") is not None
    assert mem.recall("tenant-b", "a") is not None
    assert len(mem) == 2
    mem.remember(None, "huge", [1] * 11, 0)  # larger than the whole budget: not kept
    assert mem.recall(None, "huge") is None


def test_strip_stop() -> None:
    assert strip_stop([5, 6, 7], (7, 2)) == (5, 6)
    assert strip_stop([5, 6], (7,)) == (5, 6)
    assert strip_stop([], (7,)) == ()


# -- the chat prompt recalls generated ids --------------------------------------------------------
def _turn(answer_ids: list[int]) -> tuple[list[ChatMessage], str, tuple[int, ...], str]:
    """A first turn, the ids the model 'generated' for it, and the next turn's messages."""
    first = [ChatMessage("system", SYSTEM), ChatMessage("user", "Say hello.")]
    prompt = TOK.chat_prompt(first)
    answer_text = TOK.decode(answer_ids)
    nxt = [*first, ChatMessage("assistant", answer_text), ChatMessage("user", "Again.")]
    return nxt, prompt.text + answer_text, tuple(prompt.ids) + tuple(answer_ids), answer_text


def test_recalled_ids_stand_for_the_answer_text() -> None:
    # "hello" spelled in single-character ids: a tokenization the tokenizer itself never produces
    answer = [TOK.tok.token_to_id(c) for c in "hello"]
    assert None not in answer
    nxt, key, ids, text = _turn(answer)  # type: ignore[arg-type]
    assert TOK.encode(text) != answer  # re-tokenizing the text gives other ids
    mem = AnswerMemory()
    mem.remember(None, key, ids, len(ids) - len(answer))
    plain = TOK.chat_prompt(nxt)
    got = TOK.chat_prompt(nxt, recall=lambda t: mem.recall(None, t))
    assert got.ids[: len(ids)] == list(ids)  # the next prompt continues exactly the generated ids
    assert got.answer_span == (len(ids) - len(answer), len(ids))
    assert TOK.decode(got.ids) == TOK.decode(plain.ids)  # same text
    assert got.ids != plain.ids
    # the rest of the prompt (end of turn, the new user message) is tokenized as usual
    assert got.ids[len(ids) :] == plain.ids[len(plain.ids) - len(got.ids) + len(ids) :]
    # the last user turn's boundary is still found after the recalled part
    assert got.boundaries and TOK.decode(got.ids[got.boundaries[-1] :]).startswith("Again.")


def test_an_earlier_answer_is_recalled_when_the_last_one_is_not_known() -> None:
    """The last answer was not kept (or was edited): the ids of the one before it
    still stand for its text, and only the rest is tokenized."""
    answer = [TOK.tok.token_to_id(c) for c in "hello"]
    nxt, key, ids, _ = _turn(answer)  # type: ignore[arg-type]
    mem = AnswerMemory()
    mem.remember(None, key, ids, len(ids) - len(answer))
    later = [*nxt, ChatMessage("assistant", "unknown answer"), ChatMessage("user", "Once more.")]
    got = TOK.chat_prompt(later, recall=lambda t: mem.recall(None, t))
    assert got.ids[: len(ids)] == list(ids) and got.answer_span == (len(ids) - len(answer), len(ids))
    assert TOK.decode(got.ids) == TOK.decode(TOK.chat_prompt(later).ids)


def test_nothing_recalled_for_another_answer_or_tenant() -> None:
    nxt, key, ids, _ = _turn([TOK.tok.token_to_id(c) for c in "hi"])  # type: ignore[misc]
    mem = AnswerMemory()
    mem.remember("tenant-a", key, ids, 3)
    assert TOK.chat_prompt(nxt, recall=lambda t: mem.recall("tenant-b", t)).answer_span is None
    edited = [*nxt[:2], ChatMessage("assistant", "hi!"), nxt[3]]
    assert TOK.chat_prompt(edited, recall=lambda t: mem.recall("tenant-a", t)).answer_span is None


# -- the orchestrator keeps normal answers only --------------------------------------------------
class _AnswerPrefill(FakePrefill):
    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.answers: list[EngineRequest] = []

        class _Remote:
            def remote(inner, req: EngineRequest) -> None:
                self.answers.append(req)

        self.answer = _Remote()


def _orch(prefill: Any) -> Orchestrator:
    cfg = load_config(env={}, overrides={"max_model_len": 256})
    pre, dec = clients({"prefill-0": prefill}, [FakeDecode()])
    return Orchestrator(cfg, TOK, "m", None, pre, dec, RouterMetrics())


def _run(stop: tuple[str, ...] = (), plan: AnswerPlan | None = None, cancel_after: int | None = None) -> Any:
    pre = _AnswerPrefill("prefill-0")
    orch = _orch(pre)
    req = EngineRequest(RequestId("r1"), PROMPT, SamplingParams(max_tokens=8), "salt")

    async def go() -> list[Any]:
        got = []
        agen = orch.stream(req, "chat", None, stop, plan)
        async for ev in agen:
            got.append(ev)
            if cancel_after is not None and len(got) >= cancel_after:
                await agen.aclose()
                break
        return got

    events = asyncio.run(go())
    return orch, pre, events


def test_a_normal_answer_is_sent_back_and_remembered() -> None:
    orch, pre, events = _run(plan=AnswerPlan("salt", "PROMPT TEXT"))
    (warm,) = pre.answers
    gen = tuple(t for ev in events for t in ev.token_ids)
    assert warm.background and warm.request_id.startswith("answer-r1-")
    assert warm.prompt_token_ids == PROMPT + gen and warm.sampling.max_tokens == 1
    assert warm.cache_salt == "salt"
    text = "".join(ev.text for ev in events)
    want = (PROMPT + strip_stop(gen, TOK.stop_token_ids), len(PROMPT))
    assert _got(orch.answers.recall("salt", "PROMPT TEXT" + text)) == want
    assert warm.request_id != "answer-r1"  # unique: a client's own id "answer-r1" cannot collide
    assert orch.metrics.registry.get_sample_value("hybridpd_answer_checkpoints_requested_total") == 1


def test_no_answer_checkpoint_past_what_the_client_received() -> None:
    _, pre, events = _run(plan=None)
    assert pre.answers == []  # not asked for
    full = "".join(ev.text for ev in _run(plan=AnswerPlan(None, "x"))[2])
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    orch, pre, events = _run(stop=(stop,), plan=AnswerPlan(None, "x"))
    assert events[-1].finish_reason == "stop" and pre.answers == []  # a stop string cut the answer
    assert len(orch.answers) == 0
    orch, pre, _ = _run(plan=AnswerPlan(None, "x"), cancel_after=1)
    assert pre.answers == [] and len(orch.answers) == 0  # the client went away


# -- background requests never delay others ------------------------------------------------------
def _sched(budget: int = 64, seats: int = 4) -> Scheduler:
    cfg = SchedulerConfig(16, 64, 16, False, 3, budget, seats, True)
    return Scheduler(cfg, BlockPool(64), BlockPool(8))


def _seq(rid: str, n: int, background: bool = False) -> Sequence:
    req = EngineRequest(RequestId(rid), tuple(range(3, 3 + n)), SamplingParams(max_tokens=1), background=background)
    return Sequence(req, list(req.prompt_token_ids), n, [])


def _step(s: Scheduler) -> dict[str, int]:
    """One schedule() and its prefill progress, as the engine would make it."""
    work = s.schedule()
    for w in work:
        w.seq.num_computed += w.num_tokens
    return {w.seq.rid: w.num_tokens for w in work}


def test_background_work_takes_only_the_budget_others_leave() -> None:
    s = _sched()
    s.add(_seq("bg", 200, background=True))
    assert _step(s) == {"bg": 64}  # alone: it runs on the whole budget
    s.add(_seq("fg", 40))
    assert _step(s) == {"fg": 40, "bg": 16}  # the foreground prompt first, the background on what is left
    s.add(_seq("fg2", 100))
    assert _step(s) == {"fg2": 64}  # fg's prompt is done (it would decode), fg2 takes the whole budget
    assert _step(s) == {"fg2": 36, "bg": 16}


def test_background_is_not_admitted_while_another_request_waits() -> None:
    s = _sched(seats=1)
    s.add(_seq("fg", 40))
    assert _step(s) == {"fg": 40}  # fg holds the only seat
    s.add(_seq("bg", 40, background=True))
    s.add(_seq("waiting", 40))
    assert _step(s) == {}
    assert [q.rid for q in s.waiting] == ["waiting"] and [q.rid for q in s.background] == ["bg"]
    s.finish(s.running[0])
    assert _step(s) == {"waiting": 40}  # the freed seat goes to the foreground request, though bg came first


def test_a_prefill_actor_without_answers_does_not_fail_the_request() -> None:
    """E.g. an older prefill actor shared by routers of a newer version."""
    orch = _orch(FakePrefill("prefill-0"))
    req = EngineRequest(RequestId("r1"), PROMPT, SamplingParams(max_tokens=8))

    async def go() -> list[Any]:
        return [ev async for ev in orch.stream(req, "chat", None, (), AnswerPlan(None, "x"))]

    events = asyncio.run(go())
    assert events[-1].finished and events[-1].usage is not None


def test_an_answer_cut_inside_a_character_is_kept_up_to_the_cut() -> None:
    """A length finish inside a multi-byte character: the client gets the complete
    text before it, and the answer remembered and checkpointed is the ids of that
    text (the cut character's bytes are not part of it: the next turn's prompt
    holds the text the client got)."""
    ids = TOK.encode("héllo 🙂")[:-2]  # two of the emoji's four byte tokens
    whole = TOK.encode("héllo ")
    assert ids[: len(whole)] == whole and len(ids) > len(whole)
    pre = _AnswerPrefill("prefill-0", tokens=ids, produce=len(ids), finish="length", ticket=False)
    orch = _orch(pre)
    req = EngineRequest(RequestId("r1"), PROMPT, SamplingParams(max_tokens=len(ids)))

    async def go() -> list[Any]:
        return [ev async for ev in orch.stream(req, "chat", None, (), AnswerPlan(None, "x"))]

    events = asyncio.run(go())
    assert "".join(ev.text for ev in events) == "héllo "  # flushed at the end, not lost
    (warm,) = pre.answers
    assert warm.prompt_token_ids == PROMPT + tuple(whole)
    assert _got(orch.answers.recall(None, "xhéllo ")) == (PROMPT + tuple(whole), len(PROMPT))


def test_the_ids_the_client_got_the_text_of() -> None:
    """``IncrementalDetokenizer.received``: every id when nothing is unread (a trailing
    stop id has no text); before the cut when the ids end inside a character."""
    ids = TOK.encode("héllo 🙂")
    d = IncrementalDetokenizer(TOK)
    d.push(ids, final=True)
    assert d.received() == len(ids)
    d = IncrementalDetokenizer(TOK)
    d.push(ids[:-1], final=True)
    assert d.emitted == "héllo " and d.received() == len(TOK.encode("héllo "))
    d = IncrementalDetokenizer(TOK)
    d.push([*ids, *TOK.stop_token_ids[:1]], final=True)
    assert d.received() == len(ids) + 1


# -- the prefill side ---------------------------------------------------------------------------
def test_the_answer_worker_caches_prompt_and_answer_or_skips_a_long_recompute() -> None:
    import threading

    from hybridpd.engine.native.engine import NativeEngine
    from services.prefill.answers import AnswerCheckpoints
    from services.worker.engine_loop import EngineLoop
    from services.worker.metrics import PrefillCounters
    from tests.wait import wait_until

    eng = NativeEngine(load_config(env={}, overrides={"num_kv_blocks": 64}), resolve_model_dir("tiny"))
    loop = EngineLoop(eng)
    counters, lock = PrefillCounters(), threading.Lock()

    def counted() -> tuple[int, int, int]:
        with lock:
            return counters.answer_checkpoints, counters.answer_checkpoint_tokens, counters.answer_checkpoints_skipped

    worker = AnswerCheckpoints(eng, loop, lambda t: True, counters, lock, lambda n, s: None, max_recompute=100)
    try:
        ids = tuple(range(10, 10 + 90))
        assert worker.submit(EngineRequest(RequestId("a1"), ids, SamplingParams(max_tokens=1), background=True))
        wait_until(lambda: counted()[0] == 1, 60, what="the answer checkpoint")
        assert counted() == (1, 90, 0)
        with loop.lock:
            assert eng.local_hit([*ids, 7, 8], None) == 80  # the tail checkpoint of prompt + answer
        long = tuple(range(200, 200 + 150))  # nothing cached: 150 tokens to compute > 100
        assert worker.submit(EngineRequest(RequestId("a2"), long, SamplingParams(max_tokens=1), background=True))
        wait_until(lambda: counted()[2] == 1, 60, what="the long answer skipped")
        assert counted() == (1, 90, 1)
        assert not worker.submit(EngineRequest(RequestId("a3"), ids, SamplingParams(max_tokens=1)))  # not background
        assert counted() == (1, 90, 2)
    finally:
        worker.close()
        loop.close()
        eng.close()
