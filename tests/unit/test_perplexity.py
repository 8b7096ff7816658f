"""The trained tiny model has learned the language: its held-out perplexity
(text never trained on) is at least 10x lower than the random model's."""

from __future__ import annotations

import math

from hybridpd.models.bundled import resolve_model_dir
from hybridpd.models.perplexity import heldout_windows, nll


def test_trained_model_heldout_perplexity_10x_lower_than_random() -> None:
    trained, random = resolve_model_dir("tiny"), resolve_model_dir("tiny-random")
    windows = heldout_windows(trained, 2048, 256)  # the same tokens for both (same tokenizer)
    assert windows.numel() == 2048
    assert (windows == heldout_windows(random, 2048, 256)).all()
    ppl_trained, ppl_random = math.exp(nll(trained, windows)), math.exp(nll(random, windows))
    assert ppl_random >= 10 * ppl_trained, (ppl_trained, ppl_random)
