"""Why a routed prompt's tokens were (not) restored: the split behind
``hybridpd_prefix_tokens_total{outcome}`` and the ``hybridpd_*`` usage details
(``services/router/orchestrator.py``), after the hit rule of ``checkpoints.py``.
"""

from __future__ import annotations

#: how the prompt tokens of a routed request split, in this order from token 0
#: (``hybridpd_prefix_tokens_total{outcome}``; :func:`prefix_token_split`)
PREFIX_OUTCOMES = ("hit", "checkpoint_missing", "evicted", "no_shared_prefix", "eagle_replay", "below_unit")


def prefix_token_split(
    num_tokens: int, unit: int, drop_eagle_block: bool, hit: int, known: int, seen: int, backoff: int = 0
) -> dict[str, int]:
    """Why a prompt's tokens were (not) restored, as a partition of ``num_tokens``:

    - ``hit``: restored (``hit``, the tokens the prefill did not compute);
    - ``checkpoint_missing``: past the hit, up to the deepest hit ``known``
      allows (how far the prompt's attention blocks were cached anywhere, from
      the index lookup; with EAGLE one unit less, the replay unit): the KV was
      there, but no state checkpoint at a usable boundary;
    - ``evicted``: past that, up to the deepest hit ``seen`` allows (how far
      the router had sent this prefix before): cached once, gone by now;
    - ``no_shared_prefix``: the rest that a hit could have covered, up to the
      largest hit the hit rule allows (``(N - 1) // u * u``, one unit less where
      EAGLE replays);
    - ``eagle_replay``: that unit (``drop_eagle_block``: a vLLM engine with an
      EAGLE-family drafter; the router passes ``EngineProfile.eagle_drop_prefill``,
      false on both engines: a P/D prefill engine runs no drafter);
    - ``below_unit``: the tokens no hit can cover (the last partial unit, the
      token the prefill must compute, and the ``backoff`` tokens a prefill does
      not compute at all: vLLM's P/D prefill stops one token short, so its
      largest hit is ``(N - 2) // u * u``).

    >>> prefix_token_split(100, 16, False, hit=32, known=64, seen=80)
    {'hit': 32, 'checkpoint_missing': 32, 'evicted': 16, 'no_shared_prefix': 16, 'eagle_replay': 0, 'below_unit': 4}
    >>> prefix_token_split(100, 16, True, hit=32, known=64, seen=80)
    {'hit': 32, 'checkpoint_missing': 16, 'evicted': 16, 'no_shared_prefix': 16, 'eagle_replay': 16, 'below_unit': 4}
    """
    drop = unit if drop_eagle_block else 0
    computed = num_tokens - backoff if num_tokens > backoff else num_tokens
    full = max((computed - 1) // unit * unit, 0) if computed > 0 else 0
    cap = max(full - drop, 0)
    h = min(max(hit, 0), cap)
    k = min(max(known - drop, h), cap)
    s = min(max(seen - drop, k), cap)
    return {
        "hit": h,
        "checkpoint_missing": k - h,
        "evicted": s - k,
        "no_shared_prefix": cap - s,
        "eagle_replay": full - cap,
        "below_unit": num_tokens - full,
    }
