"""Output processing (services/router/output.py) on token ids alone: the stop
strings' tail window gives exactly what searching the whole text gives, and
a tail that may start a stop string is held back."""

from __future__ import annotations

import random

import pytest

from hybridpd.tokenizer import IncrementalDetokenizer
from services.router.output import OutputProcessor, StopWindow
from tests.unit.fake_actors import SCRIPT, TEXT, TOK

pytestmark = pytest.mark.unit


def _whole_text_reference(chunks: list[tuple[int, ...]], stop: tuple[str, ...]) -> list[tuple[str, bool, int]]:
    """By brute force over the WHOLE text after every chunk: the stop string that
    completes first (ties: list order; vLLM's rule) ends it, and the tokens after the
    one completing it are dropped from the count; else everything but the longest
    tail that is a proper prefix of a stop string is sent (all of it at the end)."""
    detok, out, count, sent = IncrementalDetokenizer(TOK), [], 0, 0
    per_token, ends = IncrementalDetokenizer(TOK), []  # the text's length after each token
    stops = [s for s in stop if s]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        if stops and len(chunk) > 1:  # token by token, as vLLM's detokenizer steps
            for j, t in enumerate(chunk):
                detok.push((t,), final=last and j == len(chunk) - 1)
        else:
            detok.push(chunk, final=last)
        for j, t in enumerate(chunk):
            per_token.push((t,), final=last and j == len(chunk) - 1)
            ends.append(len(per_token.emitted))
        count += len(chunk)
        text = detok.emitted
        hits = sorted((j + len(s), k, j) for k, s in enumerate(stops) if (j := text.find(s)) >= 0)
        if hits:
            end, _, start = hits[0]
            kept = next(k + 1 for k, e in enumerate(ends) if e >= end)
            out.append((text[sent : max(start, sent)], True, kept))
            return out
        held = 0
        if not last:
            held = max(
                (k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])), default=0
            )
        upto = max(len(text) - held, sent)
        out.append((text[sent:upto], last, count))
        sent = upto
    return out


def test_stop_window_equals_searching_the_whole_text() -> None:
    rng = random.Random(15)
    for _ in range(400):
        cut, chunks = 0, []
        while cut < len(SCRIPT):
            k = rng.choice((1, 1, 2, 3, 5))
            chunks.append(SCRIPT[cut : cut + k])
            cut += k
        stop: list[str] = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(TEXT))
            stop.append(TEXT[a : a + rng.randint(1, 8)])
        stop += rng.sample(["", "absent", "日本x", "e"], rng.randint(0, 2))
        out = OutputProcessor(TOK, stop, 3, 0)
        got = []
        for i, chunk in enumerate(chunks):
            ev = out.push(chunk, i == len(chunks) - 1, "length")
            got.append((ev.text, ev.finished, out.count))
            if ev.finished:
                break
        assert got == _whole_text_reference(chunks, tuple(stop)), (chunks, stop)


def test_stop_window_looks_only_at_the_tail() -> None:
    w = StopWindow(("STOP", "x"))
    text = "STOP" + "y" * 1000
    assert w.find(text, 1004) is None  # before the window: an earlier call searched it
    assert w.find(text, 3) == 0  # "P" was the append: STOP straddles it
    assert w.find(text + "x", 1004) == 1004
    assert StopWindow(("", "")).find("anything", 0) is None
