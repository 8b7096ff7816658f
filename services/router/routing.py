"""Routing policy: pick the prefill instance that finishes this prompt first.

For instance ``i``, with ``N`` prompt tokens, ``L_i`` its local hit, ``S`` the
store hit and ``Q_i`` the prompt tokens already queued or running on it (the
router's own count of dispatched, unfinished prefills)::

    hit_i  = max(L_i, S)                       # it loads S from the store if S > L_i
    cost_i = (N - hit_i)                       # tokens it must compute
           + STORE_LOAD_COST * max(S - L_i, 0) # loading is cheaper than computing, not free
           + Q_i                               # work ahead of us in its queue

The lowest cost wins; ties go to the instance with the fewest queued tokens,
then by name. When the index is unavailable, ``L_i = S = 0`` for all: the
policy routes on load alone (counted as decision ``index_unavailable``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

STORE_LOAD_COST = 0.1


@dataclass(frozen=True, slots=True)
class RouteDecision:
    instance: str
    expected_hit: int
    store_hit: int
    local_hit: int
    kind: str  # "local_hit" | "store_hit" | "miss" | "index_unavailable" | "forced"


def choose(
    num_tokens: int,
    instances: list[str],
    local_hits: Mapping[str, int],
    store_hit: int,
    queued: Mapping[str, int],
    index_ok: bool = True,
) -> RouteDecision:
    if not instances:
        raise ValueError("no prefill instances")

    def cost(name: str) -> tuple[float, int, str]:
        local = local_hits.get(name, 0)
        hit = max(local, store_hit)
        c = (num_tokens - hit) + STORE_LOAD_COST * max(store_hit - local, 0) + queued.get(name, 0)
        return (c, queued.get(name, 0), name)

    best = min(instances, key=cost)
    local = local_hits.get(best, 0)
    if not index_ok:
        kind = "index_unavailable"
    elif local > 0 and local >= store_hit:
        kind = "local_hit"
    elif store_hit > 0:
        kind = "store_hit"
    else:
        kind = "miss"
    return RouteDecision(best, max(local, store_hit), store_hit, local, kind)
