"""Self-distil the tiny model's EAGLE draft head on CPU (a few minutes).

    .venv/bin/python scripts/train_eagle.py [--sequences 96] [--steps 600]

1. Prompts: tokenized docstrings of the Python standard library.
2. The target (the tiny model, native engine, greedy) continues each prompt;
   the draft must predict these self-generated continuations.
3. One prefill over prompt + continuation gives the target's hidden state
   h_t and distribution p_{t+1} at every position.
4. Train the head f = D(embed(x_{t+1}), h_t): KL(p_{t+2} || q(f)) plus a
   feature regression ||f - h_{t+1}||^2, with a second unrolled step that
   feeds the draft its own f (as at proposal time).

Writes ``hybridpd/engine/native/assets/draft.safetensors`` (committed) with the
target weights' digest in its metadata, and prints the held-out greedy
acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tokenizer import corpus

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.native.model import Work
from hybridpd.engine.native.ops import rms_norm
from hybridpd.engine.native.tiny import ASSETS, TINY_CONFIG, TINY_SEED
from hybridpd.engine.native.weights import (
    init_draft_weights,
    init_weights,
    save_weights,
    weights_digest,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    texts = [t for t in corpus() if len(t) > 400]
    rng.shuffle(texts)
    prompts = [tok.encode(t).ids[: args.prompt_len] for t in texts[: args.sequences]]

    cfg = load_config(env={}, overrides={"num_kv_blocks": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 4096})
    engine = NativeEngine(cfg)
    t0 = time.time()
    reqs = [
        EngineRequest("s%d" % i, tuple(p), SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    gens = engine.generate(reqs)
    seqs = [list(r.prompt_token_ids) + gens[r.request_id] for r in reqs]
    print("generated %d sequences in %.1fs" % (len(seqs), time.time() - t0))

    model = engine.model
    hid, nxt = [], []
    with torch.inference_mode():
        for s in tqdm(seqs, desc="target features"):
            w = Work(torch.tensor(s), 0, list(range(len(s) // cfg.prefix_match_unit + 1)), model.empty_state(), False)
            model.forward([w], engine.kv_caches)
            hid.append(w.hidden.clone())
            nxt.append(torch.tensor(s))
    # Positions t with t+2 inside the sequence: inputs (x_{t+1}, h_t) -> targets h_{t+1}, p_{t+2}.
    H = torch.stack([h for h in hid])  # [S, T, hidden]
    X = torch.stack(nxt)  # [S, T]
    held = max(1, len(seqs) // 8)
    train_idx = [(s, t) for s in range(held, len(seqs)) for t in range(args.prompt_len - 1, X.shape[1] - 3)]

    weights = {k: v.clone().requires_grad_(True) for k, v in init_draft_weights(TINY_CONFIG, 7).items()}
    opt = torch.optim.AdamW(weights.values(), lr=args.lr, weight_decay=0.0)
    embed = model.embed
    final_norm, lm_head = model.final_norm, model.lm_head

    def draft(tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        e = rms_norm(embed[tokens], weights["norm_tok"], 1e-6)
        hh = rms_norm(h, weights["norm_hid"], 1e-6)
        f = torch.cat([e, hh], -1) @ weights["fc"].T
        g, u = (rms_norm(f, weights["norm_mlp"], 1e-6) @ weights["w_gate_up"].T).chunk(2, -1)
        return f + (F.silu(g) * u) @ weights["w_down"].T

    def head(f: torch.Tensor) -> torch.Tensor:
        return rms_norm(f, final_norm, 1e-6) @ lm_head.T

    bar = tqdm(range(args.steps), desc="train draft")
    for step in bar:
        batch = rng.sample(train_idx, min(args.batch, len(train_idx)))
        s_i = torch.tensor([b[0] for b in batch])
        t_i = torch.tensor([b[1] for b in batch])
        f1 = draft(X[s_i, t_i + 1], H[s_i, t_i])
        with torch.no_grad():
            p2 = torch.softmax(head(H[s_i, t_i + 1]), -1)
            p3 = torch.softmax(head(H[s_i, t_i + 2]), -1)
        f2 = draft(X[s_i, t_i + 2], f1)  # unrolled: the draft's own feature
        loss = (
            F.kl_div(F.log_softmax(head(f1), -1), p2, reduction="batchmean")
            + 0.5 * F.kl_div(F.log_softmax(head(f2), -1), p3, reduction="batchmean")
            + 0.1 * (f1 - H[s_i, t_i + 1]).pow(2).mean()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(loss="%.3f" % loss.item())

    with torch.no_grad():
        accept = 0
        total = 0
        for s in range(held):
            for t in range(args.prompt_len - 1, X.shape[1] - 2):
                f = draft(X[s, t + 1 : t + 2], H[s, t : t + 1])
                accept += int(head(f).argmax(-1).item() == X[s, t + 2].item())
                total += 1
    rate = accept / max(total, 1)
    print("held-out one-step greedy acceptance: %.3f" % rate)
    target_digest = weights_digest(init_weights(TINY_CONFIG, TINY_SEED))
    final = {k: v.detach().contiguous() for k, v in weights.items()}
    meta = {"target_sha256": target_digest, "one_step_acceptance": "%.4f" % rate, "args": json.dumps(vars(args))}
    save_weights(ASSETS / "draft.safetensors", final, meta)
    print("wrote %s" % (ASSETS / "draft.safetensors"))


if __name__ == "__main__":
    main()
