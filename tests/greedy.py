"""Greedy outputs compared across paths that may round differently.

Token-for-token equality is a fact only where two paths run the same
arithmetic (our native engine in fp32: see ``hybridpd.engine.native.ops``).
Where they legitimately differ in the last bits — bf16 on different kernels
(oneDNN picks AMX-BF16 / AVX512-BF16 / AVX2 paths by CPU model), or a
whole-prompt prefill against a P/D prefill that stops one token short and a
decode step that computes the last prompt token — a greedy argmax may flip at
a **near-tie**: a position where the reference's two best logprobs are
within ``tol``. Which side wins there depends on the machine, so a test that
demands equality past a near-tie is a test of the CPU model, not of our code.

The rule (:func:`assert_greedy_matches`), the same on every machine:

1. ``got`` equals the reference's greedy tokens up to the reference's first
   near-tie, and where the two first differ the reference has a near-tie
   (a flip is allowed only where the reference itself nearly tied);
2. teacher forcing, when ``deficits`` are given: for every token of ``got``,
   over the whole output, the reference model fed ``prompt + got[:i]`` ranks
   ``got[i]`` within ``tol`` of its best token (``deficit = max logprob -
   logprob(got[i]) <= tol``). A path that is really wrong (a corrupted KV
   block, a state restored at the wrong position) picks tokens the reference
   ranks far below its best, and fails here even past a near-tie.

``tol`` is a logprob (nats) difference; :data:`BF16_TOL` covers bf16 noise
with a wide margin (measured: logprob differences up to 0.07 between bf16
paths of the tiny models; a corrupted handoff moves them by whole nats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: logprob tolerance for paths that differ by bf16 rounding
BF16_TOL = 0.25


@dataclass(frozen=True, slots=True)
class GreedyReference:
    """A reference greedy run: its tokens and, per position, the gap between
    its best and second-best logprob."""

    tokens: list[int]
    margins: list[float]

    def first_near_tie(self, tol: float) -> int:
        """Index of the first position whose margin is below ``tol`` (len if none)."""
        return next((i for i, m in enumerate(self.margins) if m < tol), len(self.margins))


def assert_greedy_matches(
    got: Sequence[int],
    ref: GreedyReference,
    tol: float,
    deficits: Sequence[float] | None = None,
    what: str = "",
) -> None:
    """Assert ``got`` is a greedy output of the reference model up to ``tol`` (rules above)."""
    got = list(got)
    assert len(got) == len(ref.tokens), "%s: %d tokens, reference has %d" % (what, len(got), len(ref.tokens))
    k = ref.first_near_tie(tol)
    assert got[:k] == ref.tokens[:k], "%s: differs before the reference's first near-tie (position %d): %s vs %s" % (
        what,
        k,
        got,
        ref.tokens,
    )
    d = next((i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=True)) if a != b), None)
    assert d is None or ref.margins[d] < tol, (
        "%s: first differs at %d, where the reference's margin is %.3f >= %.2f"
        % (
            what,
            d,
            ref.margins[d] if d is not None else 0.0,
            tol,
        )
    )
    if deficits is not None:
        assert len(deficits) == len(got), (what, len(deficits), len(got))
        worst = max(range(len(got)), key=lambda i: deficits[i])
        assert deficits[worst] <= tol, (
            "%s: token %d (%d) is %.3f nats below the reference's best given the same prefix (tol %.2f); "
            "deficits %s" % (what, worst, got[worst], deficits[worst], tol, [round(d, 3) for d in deficits])
        )
