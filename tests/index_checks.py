"""What index tests under failure check on every lookup: never an over-promise."""

from __future__ import annotations

from hybridpd.index.prefix_index import LookupResult


def over_promised(got: LookupResult, want: LookupResult) -> bool:
    """Whether ``got`` claims more than ``want`` (everything the index held), in the store or on any instance."""
    return got.store_hit > want.store_hit or any(h > want.instance_hits.get(i, 0) for i, h in got.instance_hits.items())
