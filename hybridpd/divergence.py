"""The divergences the router saw: ``DivergenceHistory``, what ``placement.place`` expects of a prompt.

Where earlier prompts left every known prefix (their suffix lengths) gives the
depth a later sharer diverges at; how many shared a prefix at all gives the
sharers to expect (the later prompts a placed checkpoint can serve).
Tensor-free; one writer (the router's event loop).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

#: suffix lengths the router remembers
HISTORY = 512
#: pseudo-observations of the scale-free prior (its weight is PRIOR_WEIGHT / (PRIOR_WEIGHT + seen))
PRIOR_WEIGHT = 4.0
#: pseudo-observations of a prompt that shared a prefix; the most followers expected of one prompt
SHARE_PRIOR, MAX_FOLLOWERS = 1.0, 8.0


class DivergenceHistory:
    """The suffix lengths ``q = N - known`` of the last :data:`HISTORY` prompts
    that shared a prefix with an earlier one (``known >= unit``), and whether
    each looked-up prompt did. One writer (the router's event loop)."""

    def __init__(self, size: int = HISTORY) -> None:
        self.suffixes: deque[int] = deque(maxlen=size)
        self.shared: deque[bool] = deque(maxlen=size)
        self._num_shared = 0

    def __len__(self) -> int:
        return len(self.suffixes)

    def observe(self, num_tokens: int, known: int, unit: int) -> None:
        if len(self.shared) == self.shared.maxlen:
            self._num_shared -= self.shared[0]
        self.shared.append(known >= unit)
        self._num_shared += known >= unit
        if known >= unit and num_tokens > known:
            self.suffixes.append(num_tokens - known)

    def share(self) -> float:
        """The share of the looked-up prompts seen that shared a prefix with an
        earlier one, with :data:`SHARE_PRIOR` pseudo-observations that did (1
        before any was seen; ``1 / (1 + seen)`` where none did)."""
        return (self._num_shared + SHARE_PRIOR) / (len(self.shared) + SHARE_PRIOR)

    def followers(self, shares: bool = False) -> float:
        """Later prompts expected to share one's prefix: ``s / (1 - s)`` (``s``: :meth:`share`), at most 8;
        at least 1 for a prompt that ``shares`` a prefix itself (its family already has two)."""
        s = self.share()
        f = MAX_FOLLOWERS if s >= 1.0 else min(s / (1.0 - s), MAX_FOLLOWERS)
        return max(f, 1.0) if shares else f

    def depth_cdf(self, num_tokens: int, drop: int, unit: int, xs: np.ndarray) -> np.ndarray:
        """``P(D < x)`` for each ``x`` in ``xs``: the mixture of the seen suffixes
        and the log-uniform prior, for a prompt of ``num_tokens`` (given that a
        later prompt shares a prefix with it)."""
        n = num_tokens
        seen = len(self.suffixes)
        lam = PRIOR_WEIGHT / (PRIOR_WEIGHT + seen)
        # prior: q log-uniform on [unit, n]; D = n - q - drop < x  <=>  q > n - drop - x
        t = np.clip(n - drop - xs, unit, n).astype(np.float64)
        span = math.log(max(n, unit + 1) / unit)
        prior = 1.0 - np.log(t / unit) / span
        prior = np.where(n - drop - xs < unit, 1.0, prior)
        if not seen:
            return prior
        depths = np.sort(n - drop - np.asarray(self.suffixes, dtype=np.int64))
        emp = np.searchsorted(depths, xs, side="left") / seen
        return lam * prior + (1.0 - lam) * emp
