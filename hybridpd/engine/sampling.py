"""How a request's tokens are picked: :class:`SamplingParams` (and the grammar of
:class:`StructuredOutput`), and what a token's log-probabilities report
(:class:`TokenLogprobs`). Plain data, no torch: the router builds them, both
engines read them (``engine/native/logits.py``, ``engine/vllm/sampling.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow (vLLM's ``StructuredOutputsParams``): exactly
    one of ``json`` (a JSON schema, as JSON text), ``json_object``, ``regex``,
    ``choice`` or ``grammar`` (EBNF / Lark) is set."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    #: vLLM's option: no whitespace inside generated JSON beyond this pattern
    whitespace_pattern: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (exact).

    The logits pass through, in order (vLLM's order): ``allowed_token_ids`` (every
    other token masked), ``bad_words``, ``logit_bias`` (token id ->
    added value), ``min_tokens`` (stop ids masked until that many tokens),
    ``bad_words`` (token id sequences: the last id is masked where the output
    ends with the others), then the repetition penalty (over prompt and output:
    positive logits divided, negative multiplied), frequency and presence
    penalties (over the output), then temperature, min-p, top-k and top-p. ``logprobs``
    (k) asks for each output token's log-probability and the k most likely,
    from the model's raw logits (vLLM's default ``raw_logprobs``)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias) pairs, ids ascending
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    #: token id sequences never generated (the router tokenizes vLLM's ``bad_words``)
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: None: no logprobs; k >= 0: the sampled token's and the k most likely
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    #: after temperature: tokens below ``min_p`` times the most likely one's probability are dropped
    min_p: float = 0.0
    #: None: every token; else only these may be generated (ascending)
    allowed_token_ids: tuple[int, ...] | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature / top-k / top-p changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
            or self.allowed_token_ids is not None
        )


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log-probability under the model's raw logits, its rank
    (1: the most likely) and the ``k`` most likely tokens (id, logprob), most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
