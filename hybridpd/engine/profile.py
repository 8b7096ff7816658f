"""Engine profiles: what each engine can do, as pure data (no torch, no vLLM).

The router, the request builder, placement and the workers read an engine's
policy from its :class:`EngineProfile` instead of branching on the ``engine``
config field: which request features it honours (everything else is refused
with a 400 naming the field), its checkpoint geometry ``(u, B, a)``, how many
trailing prompt tokens its P/D prefill leaves to decode, where an EAGLE hit
drops a block, how extra checkpoints are written, and whether decode takes
delta handoffs. ``profile_of(cfg)`` is the one lookup; adding an engine adds a
profile here and a branch in ``engine/factory.py``, nothing in the router.

The README's table of what each engine supports is generated from
:data:`FEATURE_DOCS` and the profiles (``python -m hybridpd.engine.profile``);
``tests/unit/test_engine_profile.py`` checks the README holds it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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
    Feature.STRUCTURED_OUTPUTS: "`response_format` (`json_object`, `json_schema`), `structured_outputs`, `guided_json`/`regex`/`choice`/`grammar`",
}

#: features the router itself provides on every engine (README table rows)
ROUTER_FEATURES: tuple[str, ...] = (
    "`n` (the prompt computed once, then its siblings hit it)",
    "`echo`",
    "a batch of prompts on completions",
    "chat content as a list of text parts",
    "`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`",
    "`stop` strings, `include_stop_str_in_output`",
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

    def supports(self, feature: Feature) -> bool:
        return feature in self.features

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
    )


def vllm_profile(cfg: HybridPDConfig) -> EngineProfile:
    """vLLM 0.32: every feature through its own SamplingParams (decode samples every
    output token, so penalties, bias and grammars hold across P/D); its NixlConnector
    truncates a hybrid P/D prefill by one token; an EAGLE-family drafter (decode only)
    drops its last cached block; checkpoints besides the tail are staged prefixes."""
    u = cfg.prefix_match_unit
    return EngineProfile(
        name="vllm",
        features=frozenset(Feature),
        geometry=CheckpointGeometry(u, u, u),
        prefill_backoff=1,
        eagle_drop_prefill=False,  # a P/D prefill engine runs no drafter
        eagle_drop_decode=cfg.eagle,
        extra_checkpoints="staged",
        delta_handoffs=False,
        imports_checkpoints=False,
        store_entries_unreported_evictions=True,
    )


#: engine name -> its profile (the ``engine`` config field's values)
PROFILES: dict[str, Callable[[HybridPDConfig], EngineProfile]] = {"native": native_profile, "vllm": vllm_profile}


def profile_of(cfg: HybridPDConfig) -> EngineProfile:
    """The profile of the engine ``cfg`` runs."""
    return PROFILES[cfg.engine](cfg)


def support_table(cfg: HybridPDConfig | None = None) -> str:
    """The README's Markdown table: each feature, and whether each engine honours it."""
    cfg = cfg or HybridPDConfig()
    profiles = [make(cfg) for make in PROFILES.values()]
    head = "| request field | " + " | ".join("`--engine %s`" % p.name for p in profiles) + " |"
    rows = [head, "|---|" + "---|" * len(profiles)]
    for feature, doc in FEATURE_DOCS.items():
        marks = ["yes" if p.supports(feature) else "400" for p in profiles]
        rows.append("| %s | %s |" % (doc, " | ".join(marks)))
    for doc in ROUTER_FEATURES:
        rows.append("| %s | %s |" % (doc, " | ".join("yes" for _ in profiles)))
    return "\n".join(rows)


if __name__ == "__main__":
    print(support_table())
