"""The native sampler's logits processors and logprobs (``engine/native/logits.py``):
each against its formula (vLLM's), then through the engine: each changes greedy
output where it should, EAGLE on and off and a P/D handoff give the same tokens
as a plain run with every processor on, and logprobs are the raw log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native import logits
from hybridpd.errors import InvalidRequestError
from tests.unit.engine_helpers import make_engine, prompt, req

pytestmark = pytest.mark.unit

V = 8
EOS = 2


def _row() -> torch.Tensor:
    return torch.tensor([1.0, -1.0, 0.5, 2.0, -2.0, 0.0, 3.0, 0.25])


def test_nothing_to_process_leaves_the_row() -> None:
    row = _row()
    assert torch.equal(logits.process(row, SamplingParams(), [1, 2], [3], EOS), row)
    assert not SamplingParams().processes_logits


def test_logit_bias_adds_to_its_tokens() -> None:
    got = logits.process(_row(), SamplingParams(logit_bias=((1, 5.0), (6, -3.0))), [], [], EOS)
    want = _row()
    want[1] += 5.0
    want[6] -= 3.0
    assert torch.equal(got, want)


def test_min_tokens_masks_stop_ids_and_eos_until_reached() -> None:
    sp = SamplingParams(min_tokens=2, stop_token_ids=(5,))
    got = logits.process(_row(), sp, [], [7], EOS)
    assert got[EOS] == -math.inf and got[5] == -math.inf and got[3] == 2.0
    assert torch.equal(logits.process(_row(), sp, [], [7, 7], EOS), _row())  # reached: nothing masked
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)
    assert logits.process(_row(), ignoring, [], [], EOS)[EOS] == -math.inf  # masked all the same, as vLLM does


def test_bad_words_mask_the_last_token_after_the_rest() -> None:
    sp = SamplingParams(bad_words=((6,), (3, 4)))
    got = logits.process(_row(), sp, [], [1], EOS)
    assert got[6] == -math.inf and got[4] == -2.0  # (3, 4): 4 is banned only after a 3
    after = logits.process(_row(), sp, [], [1, 3], EOS)
    assert after[4] == -math.inf and after[6] == -math.inf


def test_penalties_follow_vllms_formula() -> None:
    sp = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    prompt_ids, output = [0, 1], [3, 3, 4]
    got = logits.process(_row(), sp, prompt_ids, output, EOS)
    want = _row().clone()
    for t in (0, 1, 3, 4):  # seen in prompt or output: positive / 1.5, negative * 1.5
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    want[3] -= 0.5 * 2 + 0.25
    want[4] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, want)


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top() -> None:
    row = _row()
    lp = torch.log_softmax(row, -1)
    got = logits.logprobs_of(row, 3, 2)
    assert got.logprob == pytest.approx(float(lp[3]))
    assert got.rank == 2  # only token 6 is more likely
    assert [t for t, _ in got.top] == [6, 3]
    assert got.top[0][1] == pytest.approx(float(lp[6]))
    assert logits.logprobs_of(row, 6, 0).top == ()


# -- through the engine -------------------------------------------------------------------
TOKENS = prompt(40, 11)


def _plain(**sp: object) -> list[int]:
    return make_engine().generate([req("r", TOKENS, 12, **sp)])["r"]


def test_logit_bias_forces_a_token() -> None:
    assert _plain(logit_bias=((777, 100.0),)) == [777] * 12


def test_bad_words_are_never_generated() -> None:
    base = _plain()
    banned = _plain(bad_words=((base[0],),))
    assert banned[0] != base[0] and base[0] not in banned


def test_penalties_change_a_repeating_greedy_output() -> None:
    base = make_engine().generate([req("r", TOKENS, 24)])["r"]
    assert len(set(base)) < len(base), "the tiny model repeats itself greedily: the test needs a repeat"
    pen = make_engine().generate([req("r", TOKENS, 24, frequency_penalty=2.0)])["r"]
    assert pen != base
    assert len(set(pen)) >= len(set(base))


def test_min_tokens_holds_off_eos() -> None:
    eng = make_engine()
    eos = eng.mcfg.eos_token_id
    sp = SamplingParams(max_tokens=5, logit_bias=((eos, 100.0),))
    early = eng.generate([EngineRequest(RequestId("a"), TOKENS, sp)])["a"]
    assert early == [eos]  # stops at once
    sp = SamplingParams(max_tokens=5, min_tokens=3, logit_bias=((eos, 100.0),))
    held = eng.generate([EngineRequest(RequestId("b"), TOKENS, sp)])["b"]
    assert len(held) == 4 and held[-1] == eos and eos not in held[:3]


def test_every_processor_is_exact_across_eagle_and_a_handoff() -> None:
    sp = dict(
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias=((100, 1.5), (200, -2.0)),
        min_tokens=4,
        bad_words=((300,), (5, 6)),
        logprobs=3,
    )
    r = req("x", TOKENS, 16, **sp)
    plain = make_engine()
    want = plain.generate([r])["x"]
    assert make_engine(eagle=True, num_speculative_tokens=3).generate([r])["x"] == want
    prefill, decode = make_engine(), make_engine()
    prefill.add_request(r, prefill_only=True)
    outs = []
    while prefill.has_work():
        outs.extend(prefill.step())
    fetched = prefill.take_handoff("x")
    assert fetched is not None
    decode.add_handoff(r, fetched)
    rest = []
    while decode.has_work():
        rest.extend(decode.step())
    got = [*outs[0].new_token_ids, *(t for o in rest for t in o.new_token_ids)]
    assert got == want
    lps = [*(outs[0].logprobs or ()), *(lp for o in rest for lp in (o.logprobs or ()))]
    assert len(lps) == len(got) and all(len(x.top) == 3 and x.rank >= 1 for x in lps)


def test_logprobs_match_the_recorded_logits() -> None:
    eng = make_engine(record_logits=True)
    eng.add_request(req("l", TOKENS, 6, logprobs=2))
    outs = []
    while eng.has_work():
        outs.extend(eng.step())
    toks = [t for o in outs for t in o.new_token_ids]
    lps = [x for o in outs for x in (o.logprobs or ())]
    rows = eng.logit_log["l"]  # type: ignore[index]
    for tok, lp, row in zip(toks, lps, rows, strict=True):
        ref = torch.log_softmax(row.float(), -1)
        assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-5)
        assert lp.rank == 1  # greedy: the chosen token is the most likely
        assert lp.top[0][0] == tok


def test_out_of_range_processor_fields_are_refused() -> None:
    eng = make_engine()
    for bad in (
        dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
        dict(logit_bias=((10**6, 1.0),)),
        dict(logit_bias=((5, 200.0),)),
        dict(min_tokens=99),
        dict(logprobs=21),
        dict(bad_words=((),)),
    ):
        with pytest.raises(InvalidRequestError):
            eng.add_request(req("bad", TOKENS, 6, **bad))  # type: ignore[arg-type]


def test_allowed_token_ids_mask_every_other_token() -> None:
    got = logits.process(_row(), SamplingParams(allowed_token_ids=(1, 4)), [], [], EOS)
    assert got[1] == -1.0 and got[4] == -2.0
    assert all(got[i] == -math.inf for i in range(V) if i not in (1, 4))
    assert set(_plain(allowed_token_ids=(9, 10))) <= {9, 10}


def test_min_p_drops_unlikely_tokens_after_temperature() -> None:
    from hybridpd.engine.native import sampler

    p = sampler.probs(_row()[None], SamplingParams(temperature=1.0, min_p=0.3))[0]
    full = torch.softmax(_row(), -1)
    kept = full >= 0.3 * full.max()
    assert torch.equal(p > 0, kept)
    assert torch.allclose(p[kept], full[kept] / full[kept].sum())
