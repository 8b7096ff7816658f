"""Speculative verification: greedy is exact; rejection sampling keeps p."""

from __future__ import annotations

import torch

from hybridpd.engine.base import SamplingParams
from hybridpd.engine.native import sampler


def test_greedy_verify_accepts_matching_prefix() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 1, 9]):
        logits[row, tok] = 5.0
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams()
    assert sampler.verify(logits, [3, 7, 1], None, sp, g) == [3, 7, 1, 9]
    assert sampler.verify(logits, [3, 2, 1], None, sp, g) == [3, 7]
    assert sampler.verify(logits, [0, 7, 1], None, sp, g) == [3]


def test_rejection_sampling_preserves_target_distribution() -> None:
    torch.manual_seed(0)
    v = 6
    p_logits = torch.randn(2, v)
    sp = SamplingParams(temperature=1.0)
    p = sampler.probs(p_logits, sp)
    q = torch.softmax(torch.randn(1, v) * 2, -1)  # a poor draft
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(v)
    n = 20000
    for _ in range(n):
        y = int(torch.multinomial(q[0], 1, generator=g))
        first = sampler.verify(p_logits, [y], q, sp, g)[0]
        counts[first] += 1
    empirical = counts / n
    assert torch.allclose(empirical, p[0], atol=0.015), (empirical, p[0])


def test_top_k_top_p_filtering() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = sampler.probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    p = sampler.probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0


def test_subnormal_top_p_keeps_the_top_token() -> None:
    # found by the HTTP fuzzer: 5e-324 rounds to 0 in float32 and used to drop every token (NaN probabilities)
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    p = sampler.probs(logits, SamplingParams(temperature=1.0, top_p=5e-324))
    assert p.tolist() == [[0.0, 1.0, 0.0]]
    assert sampler.pick(logits[0], SamplingParams(temperature=1.0, top_p=5e-324), torch.Generator()) == 1
