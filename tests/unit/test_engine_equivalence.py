"""Native engine: every execution path gives the tokens of a plain run.

Reference = one request alone, one-shot prefill, prefix caching off. Compared
token for token (greedy) and logits within 1e-4 (fp32): chunked prefill under
several budgets with all requests batched, a prefix hit at every valid
checkpoint, export -> import into a fresh engine, and EAGLE on; the prefill ->
decode handoff (over NIXL) token for token; batch composition with logits
``torch.equal``. Every test runs on both bundled models (``tiny``: trained
weights, real-text-like logits; ``tiny-random``: seeded random weights), at
``mamba_block_size`` B = 64 (vLLM's align-mode columns) and, in the cases
marked ``Bu``, at the default B = u.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from hybridpd.engine.native.handoff import NativeTicket
from tests.unit.engine_helpers import (
    BLOCKS,
    assert_no_leaks,
    block_id,
    bundled_model_fixture,  # noqa: F401  (autouse: both bundled models)
    make_engine,
    prompt,
    req,
)
from tests.wait import wait_until

#: exactness tests: only where fp32 matmul rows are batch-invariant (checked)
pytestmark = pytest.mark.usefixtures("fp32_row_exact")

LENGTHS = [1, 15, 16, 17, 63, 64, 65, 100, 257, 700, 1301, 2000]
PROMPTS = {"p%d" % n: prompt(n, seed=n) for n in LENGTHS}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference(bundled_model: str) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    out = {}
    for rid, toks in PROMPTS.items():
        eng = make_engine(enable_prefix_caching=False, record_logits=True)
        got = eng.generate([req(rid, toks, MAX_TOKENS)])
        assert eng.logit_log is not None
        out[rid] = (got[rid], eng.logit_log[rid])
        assert_no_leaks(eng)
    return out


def _check(reference, rid: str, tokens: list[int], logits: list[torch.Tensor] | None = None) -> None:  # type: ignore[no-untyped-def]
    want_tokens, want_logits = reference[rid]
    assert tokens == want_tokens, rid
    if logits is not None:
        assert len(logits) == len(want_logits)
        for a, b in zip(logits, want_logits, strict=True):
            assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ("budget", "block"),
    # B = u at one budget: chunks of 48 cross its checkpoints (EAGLE on/off runs them at 4096)
    [(16, 64), (48, 64), (128, 64), (1000, 64), (48, None)],
    ids=["16-B64", "48-B64", "128-B64", "1000-B64", "48-Bu"],
)
def test_chunked_batched_equals_reference(reference, budget: int, block: int | None) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(max_num_batched_tokens=budget, record_logits=True, mamba_block_size=block)
    got = eng.generate([req(rid, toks, MAX_TOKENS) for rid, toks in PROMPTS.items()])
    assert eng.logit_log is not None
    for rid in PROMPTS:
        _check(reference, rid, got[rid], eng.logit_log[rid])
    assert_no_leaks(eng)


def _valid_hits(n: int, unit: int = 16, block: int = 64) -> list[int]:
    # checkpoints from a prefix request of length L + 1 (start 0): L multiple of
    # 16 with ceil((L+1)/B) - 2 > -1, i.e. L >= B; and L < n.
    return [L for L in range(block, n, unit)]


@pytest.mark.parametrize(
    ("rid", "hits", "block"),
    [
        ("p257", _valid_hits(257), 64),
        ("p700", [64, 336, 688], 64),
        ("p2000", [64, 1024, 1984], 64),
        # B = u: every unit boundary is valid, below 64 too
        ("p257", [16, 32, 48, 144], None),
        ("p2000", [1040], None),
    ],
    ids=["p257-B64", "p700-B64", "p2000-B64", "p257-Bu", "p2000-Bu"],
)
def test_prefix_hit_at_valid_checkpoints(reference, rid: str, hits: list[int], block: int | None) -> None:  # type: ignore[no-untyped-def]
    toks = PROMPTS[rid]
    for hit in hits:
        eng = make_engine(export_checkpoints=True, record_logits=True, mamba_block_size=block)
        eng.generate([req("warm", toks[: hit + 1], 1)])
        exported = [st.meta.position for _, st in eng.pop_exports()]
        assert exported == [hit], (hit, exported)
        outs = []
        eng.add_request(req(rid, toks, MAX_TOKENS))
        while eng.has_work():
            outs.extend(eng.step())
        assert outs[0].num_cached_tokens == hit
        assert eng.logit_log is not None
        _check(reference, rid, [t for o in outs for t in o.new_token_ids], eng.logit_log[rid])
        assert_no_leaks(eng)


@pytest.mark.parametrize(
    ("rid", "block"), [("p700", 64), ("p2000", 64), ("p700", None)], ids=["p700-B64", "p2000-B64", "p700-Bu"]
)
def test_export_import_into_fresh_engine(reference, rid: str, block: int | None) -> None:  # type: ignore[no-untyped-def]
    toks = PROMPTS[rid]
    src = make_engine(export_checkpoints=True, mamba_block_size=block)
    src.generate([req("warm", toks[: len(toks) // 2], 1)])
    ((kv, state),) = src.pop_exports()
    dst = make_engine(record_logits=True, mamba_block_size=block)
    assert dst.import_checkpoint(kv, state, list(toks))
    eng_out = []
    dst.add_request(req(rid, toks, MAX_TOKENS))
    while dst.has_work():
        eng_out.extend(dst.step())
    assert eng_out[0].num_cached_tokens == state.meta.position > 0
    assert dst.logit_log is not None
    _check(reference, rid, [t for o in eng_out for t in o.new_token_ids], dst.logit_log[rid])
    assert_no_leaks(src)
    assert_no_leaks(dst)


@pytest.mark.parametrize(
    ("rid", "eagle", "block"),
    [
        pytest.param(rid, eagle, block, id="%s-%s-%s" % (rid, eagle, block_id(block)))
        for rid, eagle, block in [(r, e, 64) for e in (False, True) for r in ("p1", "p65", "p1301")]
        + [("p1301", True, None)]
    ],
)
def test_prefill_decode_handoff(reference, rid: str, eagle: bool, block: int | None) -> None:  # type: ignore[no-untyped-def]
    """Through the engine boundary, as the workers call it: real NIXL agents
    (both in this process), the ticket pickled as it is across Ray."""
    prefill = make_engine(eagle=eagle, role="prefill", instance="prefill-%s" % rid, mamba_block_size=block)
    decode = make_engine(eagle=eagle, role="decode", instance="decode-%s" % rid, mamba_block_size=block)
    try:
        r = req(rid, PROMPTS[rid], MAX_TOKENS)
        prefill.add_request(r, prefill_only=True)
        first = []
        while prefill.has_work():
            first.extend(prefill.step())
        ticket = prefill.pop_handoff(rid)
        assert isinstance(ticket, NativeTicket) and ticket.nbytes > 0
        assert prefill.pop_handoff(rid) is None
        fetched = decode.fetch_handoff(r, pickle.loads(pickle.dumps(ticket)))
        decode.add_handoff(r, fetched)
        rest = []
        while decode.has_work():
            rest.extend(decode.step())
        tokens = [ticket.first_token_id] + [t for o in rest for t in o.new_token_ids]
        assert [t for o in first for t in o.new_token_ids] == [ticket.first_token_id]
        _check(reference, rid, tokens)
        assert_no_leaks(prefill)
        assert_no_leaks(decode)
        # decode's release notification is asynchronous
        wait_until(lambda: prefill.handoff_stats().outstanding == 0, 10, 0.01, "prefill to see the release")
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_eagle_on_equals_off(reference, block: int | None) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(eagle=True, num_speculative_tokens=3, record_logits=True, mamba_block_size=block)
    got = eng.generate([req(rid, toks, MAX_TOKENS) for rid, toks in PROMPTS.items()])
    assert eng.logit_log is not None
    for rid in PROMPTS:
        _check(reference, rid, got[rid], eng.logit_log[rid])
    assert eng.spec.steps > 0 and eng.spec.mean_acceptance_length >= 1.0
    assert_no_leaks(eng)


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_batch_composition_does_not_change_results(reference, block: int | None) -> None:  # type: ignore[no-untyped-def]
    # the same request beside different neighbours, staggered arrivals
    eng = make_engine(max_num_batched_tokens=256, record_logits=True, mamba_block_size=block)
    for rid in ["p2000", "p17", "p700"]:
        eng.add_request(req(rid, PROMPTS[rid], MAX_TOKENS))
        eng.step()
    out: dict[str, list[int]] = {"p2000": [], "p17": [], "p700": []}
    while eng.has_work():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    # first step outputs were consumed above only for requests that finished prefill then
    assert eng.logit_log is not None
    for rid in out:
        assert len(eng.logit_log[rid]) == MAX_TOKENS
        for a, b in zip(eng.logit_log[rid], reference[rid][1], strict=True):
            assert torch.equal(a, b), rid
    assert_no_leaks(eng)
