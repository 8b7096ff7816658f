"""The shared-prefix benchmark's variants: their names and the ``hybridpd up``
flags each runs with (``hybridpd bench shared-prefix --variant``).

Contract: ``variants(w)`` maps every variant name to its flags; the vLLM-alone
variants (``VLLM_VARIANTS``) take none (``bench.shared_prefix_run`` starts their
servers itself), and ``STACK_VLLM_VARIANTS`` run from the vLLM environment.
"""

from __future__ import annotations

from bench.shared_prefix import Workload

#: ``branch-aware`` through 4 routers sharing the index and the actors (#30)
ROUTERS_VARIANT = "branch-aware-4routers"
ROUTERS = 4
#: the variants that are vLLM alone, not our stack (``bench.shared_prefix_run._run_vllm``): plain ``vllm
#: serve`` and vLLM's own prefill/decode disaggregation (bench/vllm_pd.py)
VLLM_VARIANTS = ("vllm-direct", "vllm-pd", "vllm-pd-shipped")
#: vLLM's own P/D as measured against: with NIXL's progress thread off (``vllm-pd``,
#: bench/vllm_pd.py says why) and as vLLM ships it (``vllm-pd-shipped``)
PD_BASELINES = ("vllm-pd", "vllm-pd-shipped")
#: stack-vllm with vLLM's ``prefix_cache_retention_interval`` at its scheduler block (640
#: tokens for the tiny model under STACK_VLLM_ARGS, as vLLM reports when the interval is
#: not a multiple of it; at or below the block vLLM keeps every chunk end's state: dense)
#: against stack-vllm's 0: the hit-rate/memory trade-off of #26
STACK_VLLM_DENSE = "stack-vllm-retain-dense"
TINY_SCHEDULER_BLOCK = 640
#: our stack on the vLLM engine (``hybridpd up --engine vllm``, 2 prefill + 1 decode,
#: branch-aware: router-chosen checkpoints as vLLM prefixes, placement too: ``--vllm-placement``,
#: the default, named so the variant says what it runs),
#: run from the vLLM environment
STACK_VLLM = "stack-vllm"
STACK_VLLM_ARGS = (
    *("--engine", "vllm", "--model", "tiny", "--num-prefill", "2", "--num-decode", "1"),
    *("--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--checkpoint-policy", "branch-aware"),
    "--vllm-placement",
)
#: stack-vllm with one prefill actor: engine for engine what vllm-pd runs (one prefill and
#: one decode engine), to measure what the second prefill engine costs on these cores
STACK_VLLM_1P1D = "stack-vllm-1p1d"
#: stack-vllm without the P/D tail stage (``--no-vllm-tail-stage``): a prompt of k u + 1
#: tokens leaves k u - u, as vllm-pd's does, and spends no engine step on k u
STACK_VLLM_NO_TAIL = "stack-vllm-no-tail-stage"
#: stack-vllm without vLLM's MooncakeStoreConnector (``--no-vllm-store``): what the store's
#: lookups and puts cost the plan's TTFT where they share the compute cores
STACK_VLLM_NO_STORE = "stack-vllm-no-store"
#: every variant that is our stack on the vLLM engine (run from the vLLM environment)
STACK_VLLM_VARIANTS = (STACK_VLLM, STACK_VLLM_DENSE, STACK_VLLM_1P1D, STACK_VLLM_NO_TAIL, STACK_VLLM_NO_STORE)

#: branch-aware with ``checkpoint_placement: off``: the policy before placement (#27)
PLACEMENT_OFF = "branch-aware-placement-off"


def variants(w: Workload) -> dict[str, list[str]]:
    """``hybridpd up`` flags per variant (vllm-direct, vllm-pd: see ``bench.shared_prefix_run._run_vllm``). Answer
    checkpoints (issue #17: prefill the model's own answer after a chat turn) are
    off where the config has them: the plan's answers are made up, so no later
    request continues the model's, and their prefills would add store bytes."""
    from hybridpd.config import HybridPDConfig

    common = ["--prefix-match-unit", str(w.unit), "--mamba-block-size", str(w.mamba_block_size)]
    if "answer_checkpoints" in HybridPDConfig.model_fields:
        common.append("--no-answer-checkpoints")
    out = {
        "tail-only": [*common, "--checkpoint-policy", "tail-only"],
        "branch-aware": [*common, "--checkpoint-policy", "branch-aware"],
        "nocache": [*common, "--no-enable-prefix-caching"],
        "vllm-direct": [],
        "vllm-pd": [],
        "vllm-pd-shipped": [],
        ROUTERS_VARIANT: [*common, "--checkpoint-policy", "branch-aware"],
        STACK_VLLM: ["--prefix-match-unit", str(w.unit), *STACK_VLLM_ARGS, *common[4:]],
    }
    out[STACK_VLLM_DENSE] = [*out[STACK_VLLM], "--vllm-retention-interval", str(TINY_SCHEDULER_BLOCK)]
    one = list(out[STACK_VLLM])
    one[one.index("--num-prefill") + 1] = "1"
    out[STACK_VLLM_1P1D] = one
    out[STACK_VLLM_NO_TAIL] = [*out[STACK_VLLM], "--no-vllm-tail-stage"]
    out[STACK_VLLM_NO_STORE] = [*out[STACK_VLLM], "--no-vllm-store"]
    if "checkpoint_placement" in HybridPDConfig.model_fields:  # #27: placement's own effect
        out[PLACEMENT_OFF] = [*common, "--checkpoint-policy", "branch-aware", "--checkpoint-placement", "off"]
        out["tail-only"] += ["--checkpoint-placement", "off"]
    return out
