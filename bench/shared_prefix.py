"""The shared-prefix workload: prompts that branch off each other, not just grow.

Three phases, each once with token-id prompts (``/v1/completions``) and once
with chat prompts (``/v1/chat/completions``), all requests one after another:

* ``fanout``: N conversations share a system prompt whose length is not a
  multiple of the unit, each with its own first message;
* ``tree``: an agent tree: a trunk request, F forks of it, F forks of each
  fork; a child is its parent's prompt + a made-up answer to it + its own
  message, so siblings share their parent's answer too (past its tail);
* ``multiturn``: the first K conversations of ``fanout`` continue for T turns
  (a made-up answer + a new message each), interleaved turn by turn;
* ``twosharer``: RAG-style pairs: a short header shared by every pair, then
  each pair's own document of random length (``doc_min_tokens`` to ``doc_max_tokens``), then each
  request's own question: a document is shared by exactly two requests, and
  the second finds only what the first left along its prompt.

The ideal of a request is the longest token prefix it shares with any earlier
request of the same run (all phases; each is sent after the earlier ones
completed), at most its length - 1 (one token is always computed), rounded
down to the unit. Every prompt's length is kept off a unit multiple, so a
prefix that is a whole earlier prompt is within the ideal's reach.

Variants (each on a fresh ``hybridpd up``, the bundled ``tiny`` model, u = 16,
EAGLE off): ``tail-only`` and ``branch-aware`` (``checkpoint_policy``),
``nocache``, and ``vllm-direct`` (plain ``vllm serve`` of the tiny Qwen3-Next,
prefix caching at unit u with vLLM's ``enable_mamba_shared_prefix_checkpoint``;
left out with a note without ``.venv-vllm``). This module is the plan and the
arithmetic, pure (``build_plan``, ``ideal_tokens``, ``summarize``;
``tests/unit/test_bench_shared_prefix.py``); ``bench.shared_prefix_run`` runs it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Messages = tuple[tuple[str, str], ...]  # (role, content) pairs
ChatEncoder = Callable[[Messages], list[int]]

PHASES = ("fanout", "tree", "multiturn", "twosharer")
KINDS = ("ids", "chat")
#: per phase kind, which requests the hit ratio counts (``hit_ratio_all`` counts all)
COUNTING = {
    "fanout_ids": "conversations 3..N: the 1st has nothing earlier; a token-id prompt's junction is unknown"
    " until the 2nd shows where prompts diverge, so the 2nd can leave it but not hit it",
    "fanout_chat": "conversations 2..N: the 1st has nothing earlier (its message boundaries are known at once)",
    "tree_ids": "every request",
    "tree_chat": "every request",
    "multiturn_ids": "every request",
    "multiturn_chat": "every request",
    "twosharer_ids": "the second request of each pair (the first shares only the header)",
    "twosharer_chat": "the second request of each pair (the first shares only the header)",
}
#: docstring English for chat text (the tiny model is trained on docstrings)
WORDS = (
    "the a an of to in for with on by from as at is are be return returns value values string list dict"
    " object objects type types name names file files path data default argument arguments function method"
    " class instance module attribute key keys item items number index result results error errors raise"
    " raised if when not none true false this that which each new given used use set get call called"
    " buffer stream line lines text byte bytes size length first last next read write open close node tree"
    " option options format parse parser token tokens number count state cache request response server"
).split()


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 16  # fanout
    system_tokens: int = 300
    message_tokens: int = 40
    trunk_tokens: int = 200  # tree
    forks: int = 3
    tree_answer_tokens: int = 64
    turn_conversations: int = 4  # multiturn
    turns: int = 4
    turn_tokens: int = 32  # each made-up answer and each new message
    pairs: int = 6  # twosharer
    header_tokens: int = 24
    doc_min_tokens: int = 300
    doc_max_tokens: int = 3000
    max_tokens: int = 4
    unit: int = 16
    mamba_block_size: int = 16  # the default config's
    seed: int = 0


QUICK = Workload(
    conversations=5,
    system_tokens=150,
    message_tokens=24,
    trunk_tokens=100,
    forks=3,
    tree_answer_tokens=48,
    turn_conversations=2,
    turns=2,
    turn_tokens=24,
    pairs=4,
    doc_min_tokens=100,
    doc_max_tokens=800,
    max_tokens=2,
)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request: ``tokens`` (a token-id prompt) or ``messages`` (chat)."""

    phase: str  # "<phase>_<kind>", e.g. "fanout_ids"
    label: str
    tokens: tuple[int, ...] = ()
    messages: Messages = ()
    counted: bool = True

    @property
    def chat(self) -> bool:
        return bool(self.messages)


# -- the plan (pure) ------------------------------------------------------


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def ideal_tokens(prompts: Sequence[Sequence[int]], unit: int) -> list[int]:
    """Per prompt: the longest prefix it shares with any earlier prompt, at most
    its length - 1, rounded down to ``unit``."""
    out = []
    for i, p in enumerate(prompts):
        best = max((lcp(p, q) for q in prompts[:i]), default=0)
        out.append(min(best, len(p) - 1) // unit * unit)
    return out


class _Ids:
    """Token-id prompts: fresh random ids, lengths kept off unit multiples."""

    def __init__(self, rng: random.Random, unit: int) -> None:
        self.rng, self.unit = rng, unit

    def fresh(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(5, 2048) for _ in range(n))

    def start(self, n: int) -> tuple[int, ...]:
        """A shared beginning of ``n`` ids (one more if ``n`` is a unit multiple)."""
        return self.fresh(n + 1 if n % self.unit == 0 else n)

    def answer(self, prefix: tuple[int, ...], n: int) -> tuple[int, ...]:
        return prefix + self.fresh(n)

    def message(self, prefix: tuple[int, ...], n: int) -> tuple[int, ...]:
        """``prefix`` + ``n`` to ``n + 8`` fresh ids, the total not a unit multiple."""
        n += self.rng.randrange(0, 8)
        if (len(prefix) + n) % self.unit == 0:
            n += 1
        return prefix + self.fresh(n)


class _Chat:
    """Chat prompts: made-up docstring English sized in tokens with ``encode``."""

    def __init__(self, rng: random.Random, unit: int, encode: ChatEncoder) -> None:
        self.rng, self.unit, self.encode = rng, unit, encode
        sample = " ".join(WORDS)
        self.tokens_per_word = max(len(encode((("user", sample),))) - len(encode((("user", ""),))), 1) / len(WORDS)

    def text(self, n_tokens: int) -> str:
        words = max(int(n_tokens / self.tokens_per_word), 1)
        return " ".join(self.rng.choice(WORDS) for _ in range(words)).capitalize() + "."

    def _longer(self, text: str) -> str:
        return text[:-1] + " " + self.rng.choice(WORDS) + "."

    def start(self, n_tokens: int) -> Messages:
        """A system message whose shared part (up to where two first messages
        diverge) is not a unit multiple."""
        text = self.text(n_tokens)
        while True:
            a = self.encode((("system", text), ("user", "Alpha.")))
            b = self.encode((("system", text), ("user", "Zeta.")))
            if lcp(a, b) % self.unit:
                return (("system", text),)
            text = self._longer(text)

    def answer(self, prefix: Messages, n_tokens: int) -> Messages:
        return (*prefix, ("assistant", self.text(n_tokens)))

    def message(self, prefix: Messages, n_tokens: int) -> Messages:
        """``prefix`` + a user message, longer by a word while the rendered prompt's
        length is a unit multiple."""
        text = self.text(n_tokens)
        while len(self.encode((*prefix, ("user", text)))) % self.unit == 0:
            text = self._longer(text)
        return (*prefix, ("user", text))


def build_plan(w: Workload, encode: ChatEncoder) -> list[PlannedRequest]:
    """Every request of one run, in sending order: the three phases with token
    ids, then the three with chat messages (``encode``: messages -> the prompt's
    token ids, used here only to size the text)."""
    rng = random.Random(w.seed)
    return _phases("ids", _Ids(rng, w.unit), w) + _phases("chat", _Chat(rng, w.unit, encode), w)


def _phases(kind: str, gen: Any, w: Workload) -> list[PlannedRequest]:
    """The three phases with ``gen`` (``_Ids`` or ``_Chat``) making the prompts."""

    def req(phase: str, label: str, prompt: Any, counted: bool = True) -> PlannedRequest:
        p = "%s_%s" % (phase, kind)
        if kind == "chat":
            return PlannedRequest(p, label, messages=prompt, counted=counted)
        return PlannedRequest(p, label, tokens=prompt, counted=counted)

    out: list[PlannedRequest] = []
    # fanout: a shared system prompt, then each conversation's own message
    shared = gen.start(w.system_tokens)
    convs = [gen.message(shared, w.message_tokens) for _ in range(w.conversations)]
    first_counted = 1 if kind == "chat" else 2  # see COUNTING
    out += [req("fanout", "conv%d" % (i + 1), c, i >= first_counted) for i, c in enumerate(convs)]
    # tree: the trunk, its forks, their forks (breadth first); siblings share their parent's answer
    trunk = gen.message(gen.start(w.trunk_tokens - w.message_tokens), w.message_tokens)
    out.append(req("tree", "trunk", trunk))
    level = [("fork", trunk)]
    for _ in range(2):
        level = [
            ("%s%d" % (name, j + 1), gen.message(answered, w.message_tokens))
            for name, answered in ((n, gen.answer(p, w.tree_answer_tokens)) for n, p in level)
            for j in range(w.forks)
        ]
        out += [req("tree", name, p) for name, p in level]
        level = [(name + ".", p) for name, p in level]
    # multiturn: the first conversations of fanout go on, turn by turn
    prompts = convs[: w.turn_conversations]
    for t in range(w.turns):
        prompts = [gen.message(gen.answer(p, w.turn_tokens), w.turn_tokens) for p in prompts]
        out += [req("multiturn", "conv%d/turn%d" % (i + 1, t + 2), p) for i, p in enumerate(prompts)]
    # twosharer: a header for all, a document per pair, a question per request
    header = gen.start(w.header_tokens)
    for j in range(w.pairs):
        doc = gen.answer(header, random.Random(w.seed * 1000 + j).randint(w.doc_min_tokens, w.doc_max_tokens))
        for side in "ab":
            out.append(req("twosharer", "pair%d%s" % (j + 1, side), gen.message(doc, w.message_tokens), side == "b"))
    return out


# -- the arithmetic (pure) -------------------------------------------------


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _sum_split(splits: Sequence[dict[str, int] | None]) -> dict[str, int] | None:
    if not splits or any(x is None for x in splits):
        return None
    out: dict[str, int] = {}
    for x in splits:
        for k, v in (x or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def summarize(records: Sequence[dict[str, Any]], state_bytes: dict[str, int] | None) -> dict[str, Any]:
    """Per phase from per-request records (``phase``, ``label``, ``counted``,
    ``cached_tokens``, ``ideal_tokens``, ``ttft_ms``): the counted requests' cached
    and ideal tokens and their ratio, the same over all requests, TTFT p50/p90
    (all requests), ``state_bytes`` (written during the phase) per cached token,
    which requests could leave no tail checkpoint (records with ``tail_checkpoint``),
    and ``prefix_tokens``: the router's split of prompt tokens by outcome
    (``usage.hybridpd_prefix_tokens``: hit, checkpoint_missing, evicted, ...), summed."""
    phases: dict[str, Any] = {}
    for phase in dict.fromkeys(r["phase"] for r in records):
        rs = [r for r in records if r["phase"] == phase]
        counted = [r for r in rs if r["counted"]]
        cached, ideal = sum(r["cached_tokens"] for r in counted), sum(r["ideal_tokens"] for r in counted)
        cached_all, ideal_all = sum(r["cached_tokens"] for r in rs), sum(r["ideal_tokens"] for r in rs)
        ttft = [r["ttft_ms"] for r in rs]
        sb = None if state_bytes is None else state_bytes.get(phase)
        phases[phase] = {
            "requests": len(rs),
            "counted": [r["label"] for r in counted],
            "cached_tokens": cached,
            "ideal_tokens": ideal,
            "hit_ratio": cached / ideal if ideal else float("nan"),
            "cached_tokens_all": cached_all,
            "ideal_tokens_all": ideal_all,
            "hit_ratio_all": cached_all / ideal_all if ideal_all else float("nan"),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": _pct(ttft, 0.9),
            "state_bytes": sb,
            "state_bytes_per_cached_token": sb / cached_all if sb is not None and cached_all else None,
            "prefix_tokens": _sum_split([r.get("prefix_tokens") for r in rs]),
            "tails_forbidden": None
            if "tail_checkpoint" not in rs[0]
            else [r["label"] for r in rs if r["tail_checkpoint"] is None],
        }
    return phases
