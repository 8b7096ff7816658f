"""Engine profiles: what each engine can do, as pure data (no torch, no vLLM).

The router, the request builder, placement and the workers read an engine's
policy from its :class:`EngineProfile` instead of branching on the ``engine``
config field: which request features it honours (everything else is refused
with a 400 naming the field), its checkpoint geometry ``(u, B, a)``, how many
trailing prompt tokens its P/D prefill leaves to decode, where an EAGLE hit
drops a block, how extra checkpoints are written, and whether decode takes
delta handoffs; and for the configuration, the dtype ``dtype: auto`` means, the
speculative methods it implements and whether ``cpu_binding: auto`` splits the
CPUs. ``profile_of(cfg)`` is the one lookup; adding an engine adds a profile
here and a branch in ``engine/factory.py``, nothing in the router.
(``tests/unit/test_engine_profile.py`` fails on a comparison of the ``engine``
field anywhere else in ``hybridpd/`` and ``services/``.)

**Where an EAGLE hit drops a block.** vLLM's EAGLE-family drafters replay the
last block of a hit (docs/DESIGN.md, "Where EAGLE replays"), but only on an
engine that runs a drafter, and a vLLM P/D prefill engine runs none
(``engine/vllm/args.py: speculative_config`` is None for the prefill role;
``VllmEngine.drop_eagle_block`` reads vLLM's scheduler, so its tail, its staged
prefixes and its hits are the plain ones). Every hit the router predicts (the
index lookup, ``RecentPrefills``, the junction and placement positions, the
``hybridpd_prefix_tokens`` split) and every hit a prefill worker loads is a
prefill engine's own, so they read :attr:`EngineProfile.eagle_drop_prefill`.
Decode's hit is not predicted anywhere: a vLLM decode engine pulls whatever its
own cache lacks from the prefill engine (NixlConnector), so the rule need not
agree across the handoff; :attr:`EngineProfile.eagle_drop_decode` is for an
engine that prefills and decodes (``role`` local or decode:
:meth:`EngineProfile.eagle_drop`).

The README's table of what each engine supports is generated from
:data:`FEATURE_DOCS` and the profiles (``python -m hybridpd.engine.profile``);
``tests/unit/test_engine_profile.py`` checks the README holds it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # NOTE: config.py reads the profiles (validation, dtype): it imports this module
    from hybridpd.config import HybridPDConfig


class Feature(enum.StrEnum):
    """Request features an engine may honour (its sampler or its output)."""

    SEED = "seed"
    STOP_TOKEN_IDS = "stop_token_ids"
    PRESENCE_PENALTY = "presence_penalty"
    FREQUENCY_PENALTY = "frequency_penalty"
    REPETITION_PENALTY = "repetition_penalty"
    LOGIT_BIAS = "logit_bias"
    MIN_TOKENS = "min_tokens"
    BAD_WORDS = "bad_words"
    LOGPROBS = "logprobs"
    MIN_P = "min_p"
    ALLOWED_TOKEN_IDS = "allowed_token_ids"
    #: response_format (json_object, json_schema) and vLLM's structured_outputs / guided_* fields
    STRUCTURED_OUTPUTS = "structured_outputs"


#: one line per feature for the README's table (the request fields it covers)
FEATURE_DOCS: dict[Feature, str] = {
    Feature.SEED: "`seed`",
    Feature.STOP_TOKEN_IDS: "`stop_token_ids`",
    Feature.PRESENCE_PENALTY: "`presence_penalty`",
    Feature.FREQUENCY_PENALTY: "`frequency_penalty`",
    Feature.REPETITION_PENALTY: "`repetition_penalty`",
    Feature.LOGIT_BIAS: "`logit_bias`",
    Feature.MIN_TOKENS: "`min_tokens`",
    Feature.BAD_WORDS: "`bad_words`",
    Feature.LOGPROBS: "`logprobs`, `top_logprobs`",
    Feature.MIN_P: "`min_p`",
    Feature.ALLOWED_TOKEN_IDS: "`allowed_token_ids`",
    Feature.STRUCTURED_OUTPUTS: "`response_format` (`json_object`, `json_schema`), `structured_outputs`",
}

#: features the router itself provides on every engine (README table rows)
ROUTER_FEATURES: tuple[str, ...] = (
    "`n` (the prompt computed once)",
    "`echo`",
    "a batch of prompts",
    "chat text parts",
    "`add_generation_prompt`",
    "`continue_final_message`",
    "`chat_template_kwargs`",
    "`tools` with `tool_choice: none`",
    "`stop`",
    "`include_stop_str_in_output`",
    "`skip_special_tokens`",
    "`truncate_prompt_tokens`",
    "`/tokenize`, `/detokenize`, `/version`",
)


@dataclass(frozen=True, slots=True)
class CheckpointGeometry:
    """Where an engine can hold a recurrent-state checkpoint (docs/DESIGN.md section 4):
    ``unit`` (u, tokens per block hash), ``block`` (B, the state cache's block) and
    ``alignment`` (a, the prefill kernel's export stride from a chunk's start; None:
    it cannot export mid-chunk)."""

    unit: int
    block: int
    alignment: int | None


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What one engine, as configured, can do (module docstring)."""

    name: str
    #: request features it honours; the rest are refused with a 400 naming the field
    features: frozenset[Feature]
    geometry: CheckpointGeometry
    #: trailing prompt tokens a P/D prefill does not compute (decode recomputes them)
    prefill_backoff: int
    #: an EAGLE hit on this engine in the prefill role drops (replays) its last cached block
    eagle_drop_prefill: bool
    #: the same in the decode role
    eagle_drop_decode: bool
    #: how checkpoints besides the tail are written: "snapshot" (mid-chunk, free) or
    #: "staged" (a prefix prefill each: an engine step, so placed only where worth one)
    extra_checkpoints: Literal["snapshot", "staged"]
    #: decode pins the blocks it holds and moves only the rest of a handoff
    delta_handoffs: bool
    #: store hits enter through the worker's loader (else the engine's own connector loads them)
    imports_checkpoints: bool
    #: it reports its store puts as cache events whose evictions it never reports, so a
    #: broken store promise must be repaired by the router
    store_entries_unreported_evictions: bool
    #: the compute dtype ``dtype: auto`` means ("auto": the model's own)
    default_dtype: str
    #: the ``speculative_method`` values it implements
    speculative_methods: frozenset[str]
    #: ``cpu_binding: auto`` splits the CPUs between prefill and decode engines on device
    #: cpu where both roles share a machine (``actor_placement: any``), as ``vllm serve``
    #: binds its CPU engines
    auto_cpu_split: bool
    #: the router adds the tokenizer's end-of-turn ids (its ``stop_tokens``) to every request's
    #: stop ids; False: the engine stops where its own server does (vLLM: EOS and the model's
    #: ``generation_config`` ids, which also end a grammar)
    tokenizer_stop_ids: bool = True
    #: its block-hash chain is ours alone, so a deployment key may set its seed
    #: (``integrity.block_hash_seed``); False: its hashes must equal the engine's own
    #: (vLLM derives ``NONE_HASH`` from ``PYTHONHASHSEED``, i.e. ``hash_seed``)
    keyed_hash_seed: bool = True
    #: the package whose version shapes the state the engine exports (part of the model
    #: identity: ``model_identity.engine_facts``); None: hybridpd's own engine
    package: str | None = None
    #: config fields this engine does not read, each with what sizes or decides it
    #: there instead: a value other than the default is a ConfigError (``config.py``),
    #: never silently ignored
    unread_config: tuple[tuple[str, str], ...] = ()

    def supports(self, feature: Feature) -> bool:
        return feature in self.features

    def eagle_drop(self, role: str) -> bool:
        """Whether an EAGLE hit drops a block on this engine in ``role`` ("prefill",
        "decode" or "local"; a local engine runs the drafter as decode does)."""
        return self.eagle_drop_prefill if role == "prefill" else self.eagle_drop_decode

    @property
    def staged(self) -> bool:
        return self.extra_checkpoints == "staged"


def native_profile(cfg: HybridPDConfig) -> EngineProfile:
    """The native engine: its sampler (``engine/native/sampler.py``) implements every
    feature but structured outputs; snapshots mid-chunk; delta handoffs over NIXL."""
    return EngineProfile(
        name="native",
        features=frozenset(Feature) - {Feature.STRUCTURED_OUTPUTS},
        geometry=CheckpointGeometry(cfg.prefix_match_unit, cfg.mamba_block_size, cfg.checkpoint_alignment),
        prefill_backoff=0,
        eagle_drop_prefill=False,  # the native draft head needs no replay block
        eagle_drop_decode=False,
        extra_checkpoints="snapshot",
        delta_handoffs=True,
        imports_checkpoints=True,
        store_entries_unreported_evictions=False,
        default_dtype="float32",
        speculative_methods=frozenset({"eagle"}),
        auto_cpu_split=False,
        unread_config=(
            ("vllm_kv_cache_memory_bytes", "num_kv_blocks and state_cache_mb size the native engine's caches"),
            ("vllm_kv_cache_blocks", "num_kv_blocks and state_cache_mb size the native engine's caches"),
        ),
    )


def vllm_profile(cfg: HybridPDConfig) -> EngineProfile:
    """vLLM 0.32: every feature through its own SamplingParams (decode samples every
    output token, so penalties, bias and grammars hold across P/D); its NixlConnector
    truncates a hybrid P/D prefill by one token; an EAGLE-family drafter (decode only)
    drops its last cached block; checkpoints besides the tail are staged prefixes.
    With speculative decoding vLLM refuses ``min_p`` and ``logit_bias``
    (``SamplingParams._validate_spec_decode``): so does the profile, before the prefill."""
    u = cfg.prefix_match_unit
    spec_refused = {Feature.MIN_P, Feature.LOGIT_BIAS} if cfg.eagle else set()
    return EngineProfile(
        name="vllm",
        features=frozenset(Feature) - spec_refused,
        geometry=CheckpointGeometry(u, u, u),
        prefill_backoff=1,  # VllmEngine.prefill_backoff (tests/vllm/test_index_truth.py checks it)
        eagle_drop_prefill=False,  # a P/D prefill engine runs no drafter (module docstring)
        eagle_drop_decode=cfg.eagle,
        extra_checkpoints="staged",
        delta_handoffs=False,
        imports_checkpoints=False,
        store_entries_unreported_evictions=True,
        # NOTE: vLLM's CPU gated-delta-net kernels are bf16-only (args.check_dtype)
        default_dtype="bfloat16" if cfg.device == "cpu" else "auto",
        speculative_methods=frozenset({"eagle", "eagle3", "mtp"}),
        auto_cpu_split=True,
        tokenizer_stop_ids=False,
        keyed_hash_seed=False,
        package="vllm",
        unread_config=(
            ("num_kv_blocks", "vllm_kv_cache_memory_bytes or vllm_kv_cache_blocks sizes vLLM's KV and state space"),
            ("state_cache_mb", "vLLM keeps recurrent states in its own Mamba cache"),
            ("handoff_timeout_s", "vLLM's NixlConnector frees unread handoffs on its own timeout"),
            ("checkpoint_alignment", "vLLM checkpoints at unit boundaries (its geometry is u, u, u)"),
        ),
    )


#: engine name -> its profile (the ``engine`` config field's values)
PROFILES: dict[str, Callable[[HybridPDConfig], EngineProfile]] = {"native": native_profile, "vllm": vllm_profile}


def profile_of(cfg: HybridPDConfig) -> EngineProfile:
    """The profile of the engine ``cfg`` runs."""
    return PROFILES[cfg.engine](cfg)


def support_table(cfg: HybridPDConfig | None = None) -> str:
    """The README's Markdown table: per engine, the features it honours and those it
    refuses with a 400; then what the router provides on every engine."""
    from hybridpd.config import load_config  # NOTE: lazy: config.py imports this module

    cfg = cfg or load_config(env={})
    rows = ["| engine | honoured | refused with a 400 naming the field |", "|---|---|---|"]
    for make in PROFILES.values():
        plain = make(cfg)
        for p, flag in ((plain, ""), (make(cfg.model_copy(update={"eagle": True})), " --eagle")):
            if flag and p.features == plain.features:
                continue
            yes = ", ".join(doc for f, doc in FEATURE_DOCS.items() if p.supports(f))
            no = ", ".join(doc for f, doc in FEATURE_DOCS.items() if not p.supports(f)) or "none"
            rows.append("| `--engine %s%s` | %s | %s |" % (p.name, flag, yes, no))
    rows.append("| every engine (the router) | %s | |" % ", ".join(ROUTER_FEATURES))
    return "\n".join(rows)


if __name__ == "__main__":
    print(support_table())
