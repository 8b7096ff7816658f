"""Our sampling parameters as vLLM's (vLLM 0.32), and vLLM's logprobs as ours.

Which requests sample with what (``VllmCore._add_to_vllm``)::

    request                                   vLLM SamplingParams
    local request, decode (add_handoff)       full: every field below
    P/D prefill (prefill_only)                plain (max_tokens=1: its token is dropped)
    checkpoint prefix (stages.py)             plain (max_tokens=1: mostly released before it samples)
    background request, P/D tail stage        plain (the output is never read)

**Decode owns all sampling.** A vLLM P/D prefill stops one prompt token short
and its sampled token is never an output token: decode recomputes the last
prompt token over the pulled KV and state and samples every output token, the
first included. So no sampling state crosses the handoff: decode's request
carries the whole prompt (vLLM's repetition penalty reads the prompt tokens of
its own request, ``InputBatch``), starts its output count at 0 (``min_tokens``,
frequency and presence penalties, ``bad_words`` prefixes) and compiles the
grammar itself (a request waits for its grammar before it is scheduled, then
for the remote KV: the first token is constrained). A plain prefill also
spares the prefill engine a grammar compilation it would throw away, and
``min_tokens`` above its ``max_tokens=1``, which vLLM refuses.

Field by field (:func:`vllm_sampling`): temperature, top-p, top-k, min-p, seed,
stop ids, ``ignore_eos``, the three penalties, ``min_tokens`` and ``logprobs``
map to vLLM's fields of the same name; ``logit_bias`` to its dict;
``allowed_token_ids`` to its list; ``bad_words`` (token-id sequences, as the
router tokenized vLLM's ``bad_words`` strings) to ``_bad_words_token_ids``,
the field vLLM's ``SamplingParams.update_from_tokenizer`` fills from the strings
and its sampler reads (``bad_words_token_ids``); vLLM's input processor
rewrites it only when ``bad_words`` (the strings) is non-empty, so the ids
reach the sampler as given (``tests/vllm/test_sampling.py`` shows it).
``structured`` becomes ``StructuredOutputsParams`` (json schema text,
json_object, regex, choice, grammar; ``whitespace_pattern`` is passed on,
though no backend of vLLM 0.32 reads it); vLLM's ``auto`` backend picks
xgrammar (guidance where xgrammar cannot), both on CPU.

Logprobs (:func:`token_logprobs`) are vLLM's default ``raw_logprobs``: the
model's log-softmax before bad words, bias and penalties (after a grammar's
mask, which vLLM applies to the logits before its sampler).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridpd.engine.sampling import SamplingParams, StructuredOutput, TokenLogprobs
from hybridpd.engine.vllm import adapter


def vllm_sampling(
    sp: SamplingParams,
    max_tokens: int,
    transfer: dict[str, Any] | None,
    *,
    full: bool,
    tag: Mapping[str, Any] | None = None,
) -> Any:
    """vLLM's ``SamplingParams`` for a request of ours: ``full`` maps every field
    (local and decode requests), otherwise plain greedy sampling of ``max_tokens``
    tokens the engine does not report (see the module docstring). Token ids in and
    out, deltas (``RequestOutputKind.DELTA``); ``transfer``: the NixlConnector's
    ``kv_transfer_params``; ``tag``: what our scheduler reads (``sequencer.Tag.extra_args``)."""
    extra = {**({"kv_transfer_params": transfer} if transfer is not None else {}), **(tag or {})}
    common: dict[str, Any] = {"max_tokens": max_tokens, "detokenize": False, "extra_args": extra or None}
    if not full:
        return adapter.sampling_params({"temperature": 0.0, "ignore_eos": True, **common})
    return adapter.sampling_params(
        dict(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            min_p=sp.min_p,
            seed=sp.seed,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=dict(sp.logit_bias) or None,
            allowed_token_ids=list(sp.allowed_token_ids) if sp.allowed_token_ids is not None else None,
            min_tokens=sp.min_tokens,
            _bad_words_token_ids=[list(word) for word in sp.bad_words] or None,
            logprobs=sp.logprobs,
            structured_outputs=structured_outputs(sp.structured),
            **common,
        )
    )


def structured_outputs(so: StructuredOutput | None) -> Any:
    """vLLM's ``StructuredOutputsParams`` for ``so`` (None: unconstrained)."""
    if so is None:
        return None
    return adapter.structured_outputs_params(
        {
            "json": so.json,
            "json_object": True if so.json_object else None,
            "regex": so.regex,
            "choice": list(so.choice) if so.choice is not None else None,
            "grammar": so.grammar,
            "whitespace_pattern": so.whitespace_pattern,
        }
    )


def token_logprobs(token_ids: Sequence[int], entries: Sequence[Mapping[int, Any]], k: int) -> tuple[TokenLogprobs, ...]:
    """Our logprobs of ``token_ids`` from vLLM's per-token dicts (token id ->
    ``Logprob(logprob, rank)``, ``flat_logprobs`` off). vLLM's sampler gathers the
    sampled token and the top ``k`` (``Sampler.gather_logprobs``) and writes them
    into one dict, the sampled token first with its own rank (how many tokens are
    at least as likely, itself included), then the top ``k`` with ranks 1..k (a sampled token among them
    keeps its place and takes its top-k rank): the ``k`` most likely are the
    entries ranked at most ``k``."""
    out = []
    for token, entry in zip(token_ids, entries, strict=True):
        own = entry[token]
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=_rank)
        out.append(TokenLogprobs(float(own.logprob), int(own.rank), tuple((t, float(lp.logprob)) for t, lp in top)))
    return tuple(out)


def _rank(item: tuple[int, Any]) -> int:
    return int(item[1].rank)
