"""Self-distil a bundled model's EAGLE draft head on CPU (minutes).

    nice -n 19 .venv/bin/python scripts/train_eagle.py [--model tiny] [--sequences 384] [--steps 2400]

1. Prompts: the training text of :mod:`hybridpd.models.corpus`
   (tokenized; held-out files are never used).
2. The target (``--model``, native engine, fp32, greedy) continues each
   prompt; the draft must predict these self-generated continuations, which
   are exactly what greedy verification accepts.
3. One prefill over prompt + continuation gives the target's hidden state
   h_t and distribution p_{t+1} at every position.
4. Train the head f = D(embed(x_{t+1}), h_t) unrolled over ``--unroll``
   steps, each later step fed the draft's own feature (as at proposal time):
   KL(p || q(f)) + cross-entropy on the target's greedy token, plus a feature
   regression ||f - h||^2.

Writes the model's committed head (``assets/draft.safetensors`` for ``tiny``,
``assets/draft-random.safetensors`` for ``tiny-random``) with the target
weights' digest in its metadata, and prints the held-out mean acceptance
length at k = 1..5 (greedy chains on held-out sequences; ``hybridpd bench
eagle`` measures it in the engine).
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

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.native.model import Work
from hybridpd.engine.native.ops import rms_norm
from hybridpd.engine.native.weights import init_draft_weights, save_weights, weights_digest
from hybridpd.model_files import TOKENIZER_DIR
from hybridpd.models import corpus
from hybridpd.models.bundled import ASSETS, BUNDLED, resolve_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(BUNDLED), default="tiny")
    ap.add_argument("--sequences", type=int, default=384)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    texts = [t for t in corpus.train_texts() if len(t) > 400]
    rng.shuffle(texts)
    prompts = [tok.encode(t, add_special_tokens=False).ids[: args.prompt_len] for t in texts[: args.sequences]]

    overrides = {"model": args.model, "num_kv_blocks": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    cfg = load_config(env={}, overrides=overrides)
    engine = NativeEngine(cfg, resolve_model_dir(cfg.model))
    t0 = time.time()
    reqs = [
        EngineRequest("s%d" % i, tuple(p), SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    gens = engine.generate(reqs)
    seqs = [list(r.prompt_token_ids) + gens[r.request_id] for r in reqs]
    print("generated %d sequences in %.1fs" % (len(seqs), time.time() - t0))

    model = engine.model
    hid = []
    with torch.inference_mode():
        for s in tqdm(seqs, desc="target features"):
            w = Work(torch.tensor(s), 0, list(range(len(s) // cfg_unit(engine) + 1)), model.empty_state(), False)
            model.forward([w], engine.kv_caches)
            hid.append(w.hidden.clone())
    # inputs (x_{t+1}, h_t) -> targets h_{t+1}, p_{t+2}; then chained on the draft's own features
    H = torch.stack(hid)  # [S, T, hidden]
    X = torch.tensor(seqs)  # [S, T]
    held = max(1, len(seqs) // 8)
    u = args.unroll
    train_idx = [(s, t) for s in range(held, len(seqs)) for t in range(args.prompt_len - 1, X.shape[1] - 1 - u)]

    mcfg = engine.mcfg
    weights = {k: v.clone().requires_grad_(True) for k, v in init_draft_weights(mcfg, 7).items()}
    opt = torch.optim.AdamW(weights.values(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    embed, final_norm, lm_head, eps = model.embed, model.final_norm, model.lm_head, mcfg.rms_eps

    def draft(tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        e = rms_norm(embed[tokens], weights["norm_tok"], eps)
        hh = rms_norm(h, weights["norm_hid"], eps)
        f = torch.cat([e, hh], -1) @ weights["fc"].T
        g, up = (rms_norm(f, weights["norm_mlp"], eps) @ weights["w_gate_up"].T).chunk(2, -1)
        return f + (F.silu(g) * up) @ weights["w_down"].T

    def head(f: torch.Tensor) -> torch.Tensor:
        return rms_norm(f, final_norm, eps) @ lm_head.T

    with torch.no_grad():
        P = torch.log_softmax(head(H), -1)  # [S, T, V] target log-probs of the next token

    bar = tqdm(range(args.steps), desc="train draft", mininterval=5)
    for _ in bar:
        batch = rng.sample(train_idx, min(args.batch, len(train_idx)))
        s_i = torch.tensor([b[0] for b in batch])
        t_i = torch.tensor([b[1] for b in batch])
        f = H[s_i, t_i]
        loss = torch.zeros(())
        for j in range(u):
            f = draft(X[s_i, t_i + 1 + j], f)
            logq = F.log_softmax(head(f), -1)
            p = P[s_i, t_i + 1 + j]
            weight = 1.0 / (j + 1)
            loss = loss + weight * (
                F.kl_div(logq, p, log_target=True, reduction="batchmean")
                + F.nll_loss(logq, X[s_i, t_i + 2 + j])
                + 0.1 * (f - H[s_i, t_i + 1 + j]).pow(2).mean()
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss="%.3f" % loss.item())

    # held-out greedy chains: from each position, propose k tokens and count the accepted
    # prefix + the target's own token (what one EAGLE step emits)
    acc = {}
    with torch.no_grad():
        for k in range(1, 6):
            lengths = []
            for s in range(held):
                T = X.shape[1]
                ts = torch.arange(args.prompt_len - 1, T - 1 - k)
                f = H[s, ts]
                tok_in = X[s, ts + 1]
                alive = torch.ones(len(ts), dtype=torch.bool)
                n_acc = torch.zeros(len(ts), dtype=torch.long)
                for j in range(k):
                    f = draft(tok_in, f)
                    guess = head(f).argmax(-1)
                    alive &= guess == X[s, ts + 2 + j]
                    n_acc += alive.long()
                    tok_in = guess
                lengths.append(n_acc + 1)
            acc[k] = torch.cat(lengths).float().mean().item()
    print("held-out mean acceptance length (greedy chains): " + ", ".join("k=%d %.2f" % kv for kv in acc.items()))
    out = ASSETS / BUNDLED[args.model][2]
    final = {k: v.detach().contiguous() for k, v in weights.items()}
    target = {k: v for k, v in model_weights(engine).items()}
    meta = {
        "target_sha256": weights_digest(target),
        "heldout_mean_acceptance_length": json.dumps(acc),
        "args": json.dumps(vars(args)),
    }
    save_weights(out, final, meta)
    print("wrote %s" % out)


def cfg_unit(engine: NativeEngine) -> int:
    return engine.cfg.prefix_match_unit


def model_weights(engine: NativeEngine) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(resolve_model_dir(engine.cfg.model) / "model.safetensors"))


if __name__ == "__main__":
    main()
