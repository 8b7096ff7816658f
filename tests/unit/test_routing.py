"""Routing policy: the documented cost formula, exactly."""

from __future__ import annotations

import pytest

from services.router.routing import STORE_LOAD_COST, choose

NAMES = ["prefill-0", "prefill-1"]


def test_local_hit_wins_over_miss() -> None:
    d = choose(1000, NAMES, {"prefill-1": 800}, 0, {})
    assert (d.instance, d.kind, d.expected_hit) == ("prefill-1", "local_hit", 800)


def test_store_hit_loads_where_queue_is_short() -> None:
    # both can load 600 from the store; prefill-0 is busy
    d = choose(1000, NAMES, {}, 600, {"prefill-0": 500})
    assert (d.instance, d.kind, d.expected_hit) == ("prefill-1", "store_hit", 600)


def test_load_outweighs_a_small_hit() -> None:
    # prefill-0 has 64 cached but 2,000 queued tokens: compute elsewhere
    d = choose(1000, NAMES, {"prefill-0": 64}, 0, {"prefill-0": 2000})
    assert d.instance == "prefill-1" and d.kind == "miss"


def test_cost_formula_values() -> None:
    # cost_0 = (1000 - 500) + 0.1 * (700 - 500) + 100 = 620 ; cost_1 = (1000 - 700) + 0.1 * 700 + 300 = 670
    d = choose(1000, NAMES, {"prefill-0": 500}, 700, {"prefill-0": 100, "prefill-1": 300})
    assert STORE_LOAD_COST == 0.1
    assert d.instance == "prefill-0" and d.kind == "store_hit"


def test_index_unavailable_routes_on_load_only() -> None:
    d = choose(1000, NAMES, {}, 0, {"prefill-0": 10, "prefill-1": 0}, index_ok=False)
    assert (d.instance, d.kind) == ("prefill-1", "index_unavailable")
    # ties break by name
    assert choose(10, NAMES, {}, 0, {}, index_ok=False).instance == "prefill-0"


def test_no_instances() -> None:
    with pytest.raises(ValueError):
        choose(10, [], {}, 0, {})
