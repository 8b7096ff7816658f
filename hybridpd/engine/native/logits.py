"""Logits processing and logprobs of the native sampler, in vLLM's order and meaning.

    raw logits --logprobs (raw log-softmax: vLLM's default ``raw_logprobs``)
               --allowed_token_ids, bad_words, logit_bias, min_tokens (vLLM's logits processors)
               --repetition, frequency, presence penalties (``apply_penalties``)
               --> processed logits (then temperature, top-k, top-p: ``sampler.probs``)

One row at a time: ``history`` is what the row's token follows (prompt and
output so far; for an EAGLE verification row, the drafts accepted before it),
so every row of a speculative step sees the same state a step-by-step decode
would, and greedy EAGLE on and off stay token-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridpd.engine.base import SamplingParams, TokenLogprobs


def process(
    logits: torch.Tensor,
    sp: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_id: int | None,
) -> torch.Tensor:
    """``logits`` (one row, any float dtype) after the request's processors, as fp32;
    ``logits`` itself is left unchanged. ``output``: the tokens generated so far."""
    x = logits.float().clone()
    vocab = x.shape[-1]
    if sp.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.tensor([t for t in sp.allowed_token_ids if 0 <= t < vocab], dtype=torch.long)] = True
        x = x.masked_fill(~keep, float("-inf"))
    for word in sp.bad_words:
        *head, last = word
        if last < vocab and (not head or tuple(output[len(output) - len(head) :]) == tuple(head)):
            x[last] = float("-inf")
    for tok, bias in sp.logit_bias:
        if 0 <= tok < vocab:
            x[tok] += bias
    if len(output) < sp.min_tokens:  # EOS too, even with ignore_eos (vLLM's all_stop_token_ids)
        stops = set(sp.stop_token_ids)
        if eos_token_id is not None:
            stops.add(eos_token_id)
        for tok in stops:
            if 0 <= tok < vocab:
                x[tok] = float("-inf")
    if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
        out = torch.tensor(list(output), dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(x.dtype) if len(output) else torch.zeros_like(x)
        seen_out = counts > 0
        if sp.repetition_penalty != 1.0:
            seen = seen_out.clone()
            if len(prompt):
                seen[torch.tensor(list(prompt), dtype=torch.long)] = True
            rp = sp.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        x = x - sp.frequency_penalty * counts - sp.presence_penalty * seen_out.to(x.dtype)
    return x


def logprobs_of(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s log-probability under the raw ``logits`` (one row), its rank (1 +
    how many tokens are strictly more likely; vLLM counts ties in, as here: the
    number of tokens at least as likely) and the ``k`` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = float(lp[token])
    rank = int((lp >= lp[token]).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprobs(own, rank, top)
