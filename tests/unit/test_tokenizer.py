"""The incremental detokenizer: deltas joined equal one decode of every id,
whatever the chunking, with multi-byte characters never split."""

from __future__ import annotations

import random

from hybridpd.model_files import TOKENIZER_DIR
from hybridpd.tokenizer import IncrementalDetokenizer, TextTokenizer

TOK = TextTokenizer(TOKENIZER_DIR)


def _ids(rng: random.Random, n: int) -> list[int]:
    text_ids = TOK.encode("Grüße, 日本語 and émigré — naïve ½ ✓ def f(x):\n    return x ** 2  # " * 3)
    pool = [rng.randrange(TOK.vocab_size) for _ in range(n)]
    return [rng.choice(text_ids) if rng.random() < 0.5 else rng.choice(pool) for _ in range(n)]


def test_deltas_join_to_the_full_decode_for_any_chunking() -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = _ids(rng, rng.randrange(1, 120))
        detok = IncrementalDetokenizer(TOK)
        out, i = [], 0
        while i < len(ids):
            k = rng.randrange(1, 6)
            delta = detok.push(ids[i : i + k])
            assert "\ufffd" not in delta[-1:], "a split character was emitted"
            out.append(delta)
            i += k
        full = TOK.decode(ids)
        assert "".join(out) == detok.emitted
        if not full.endswith("\ufffd"):
            assert detok.emitted == full


def test_a_multibyte_character_is_held_back_until_complete() -> None:
    ids = TOK.encode("日本")
    detok = IncrementalDetokenizer(TOK)
    got = [detok.push([i]) for i in ids]
    assert "".join(got) == "日本"
    assert all(g in ("", "日", "本", "日本") for g in got)


def test_final_push_sends_the_complete_text_before_a_cut_character() -> None:
    ids = TOK.encode("héllo 🙂")
    d = IncrementalDetokenizer(TOK)
    assert d.push(ids[:-2]) == ""  # the chunk ends inside the emoji: held back, more ids may come
    assert d.unread == ids[:-2]
    assert d.push(ids[-2:], final=True) == "héllo 🙂" and d.unread == []
    d = IncrementalDetokenizer(TOK)
    assert d.push(ids[:-2], final=True) == "héllo "  # the last chunk ends inside it: the rest is sent
    assert d.emitted == "héllo " and d.unread == ids[:-2]  # ...but its ids are not all covered
