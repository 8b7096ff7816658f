"""Held-out perplexity of a native model, computed by the engine's own forward pass.

    python -m hybridpd.models.perplexity [--tokens 4096] [--model tiny --model tiny-random]

Text: the held-out stdlib docstrings of :mod:`hybridpd.models.corpus`
(never trained on), tokenized with the model's tokenizer, joined with
``<eos>`` and cut into windows of ``context`` tokens; each window is one
fp32 prefill from position 0, scored on its tokens 1..context-1.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from hybridpd.engine.native.model import HybridModel, Work
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.weights import load_weights
from hybridpd.models import corpus
from hybridpd.models.bundled import resolve_model_dir


def heldout_windows(model_dir: Path, tokens: int, context: int) -> torch.Tensor:
    """``[n, context]`` held-out token windows, ``n * context >= tokens`` where the text allows."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = HybridModelConfig.load(model_dir / "config.json").eos_token_id
    ids: list[int] = []
    for enc in tok.encode_batch(corpus.heldout_texts(), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
        if len(ids) >= tokens + context:
            break
    n = max(1, min(-(-tokens // context), len(ids) // context))
    return torch.tensor(ids[: n * context]).view(n, context)


@torch.inference_mode()
def nll(model_dir: Path, windows: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats/token) of ``windows`` under the model, fp32."""
    cfg = HybridModelConfig.load(model_dir / "config.json")
    cpu = torch.device("cpu")
    model = HybridModel(cfg, load_weights(model_dir / "model.safetensors", torch.float32, cpu), cpu)
    n, ctx = windows.shape
    blocks = -(-ctx // 16)
    shape = (blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.attn_layers]
    total = 0.0
    for row in windows:
        work = Work(row, 0, list(range(blocks)), model.empty_state(), False)
        model.forward([work], caches)
        assert work.hidden is not None
        logits = model.logits(work.hidden[:-1])
        total += F.cross_entropy(logits, row[1:], reduction="sum").item()
    return total / (n * (ctx - 1))


def perplexity(model: str, tokens: int = 4096, context: int = 256) -> float:
    model_dir = resolve_model_dir(model)
    return math.exp(nll(model_dir, heldout_windows(model_dir, tokens, context)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    out = {m: perplexity(m, args.tokens, args.context) for m in (args.model or ["tiny", "tiny-random"])}
    print(json.dumps({"heldout_perplexity": out, "tokens": args.tokens, "context": args.context}, indent=2))


if __name__ == "__main__":
    main()
