"""Train the bundled tiny hybrid LM (``model: tiny``) on CPU.

    nice -n 19 .venv/bin/python scripts/train_tiny.py [--steps 1500] [--threads 2]

Architecture: the native engine's (``hybridpd/engine/native``), config
:data:`hybridpd.models.bundled.TRAINED_CONFIG` (DDDA, hidden 256, 4.0M parameters). This
script re-implements its forward pass batched and differentiable (chunked
gated delta rule, causal SDPA attention) and checks, before and after
training, that the native engine computes the same logits (fp32, max abs
difference printed; must be < 1e-3).

Data: :mod:`hybridpd.models.corpus` (stdlib + pinned packages'
docstrings; a held-out set of stdlib files is never trained on). Documents are
tokenized with the committed tokenizer, joined with ``<eos>`` and cut into
random windows of ``--context`` tokens (half of them starting at a document
start). Seeded: the same machine and package versions give the same weights.

Writes ``hybridpd/models/assets/tiny.safetensors`` (bf16; the engine
loads it in fp32), ``scripts/train_tiny.png`` (loss curve) and
``scripts/train_tiny.json`` (losses, held-out perplexity, time).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridpd.engine.native.model_config import KERNEL_CHUNK, HybridModelConfig  # noqa: E402
from hybridpd.engine.native.weights import init_weights, save_weights, weights_digest  # noqa: E402
from hybridpd.models import corpus  # noqa: E402
from hybridpd.models.bundled import ASSETS, TINY_SEED, TRAINED_CONFIG  # noqa: E402

EOS = 2


# -- the native forward, batched and differentiable -----------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(cfg: HybridModelConfig, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _delta_chunks(q, k, v, g, beta):  # type: ignore[no-untyped-def]
    """Chunked gated delta rule from a zero state, the native kernel's WY form
    (``delta._chunk``) over all chunks at once. q, k, g: [B, H, T, dk];
    v: [B, H, T, dv]; beta: [B, H, T]. Returns o [B, H, T, dv]."""
    b_, h_, t_, dk = k.shape
    c = KERNEL_CHUNK
    n = t_ // c
    q, k, v, g = (x.reshape(b_, h_, n, c, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(b_, h_, n, c)
    gc = g.cumsum(3)
    incl = torch.ones(c, c, dtype=torch.bool).tril()
    strict = torch.ones(c, c, dtype=torch.bool).tril(-1)
    # D_ti = exp(G_t - G_i) = exp(G_t) exp(-G_i), in float64 (no overflow for any
    # decay a chunk can reach), so A and M are matmuls instead of [C, C, dk] tensors
    g64 = gc.double()
    kneg = (k.double() * torch.exp(-g64)).transpose(-1, -2)
    a = ((k.double() * torch.exp(g64)) @ kneg).float() * beta[..., None, :]
    m = ((q.double() * torch.exp(g64)) @ kneg).float() * beta[..., None, :]
    low = a.masked_fill(~strict, 0.0)  # strictly lower, nilpotent: (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)
    m = m.masked_fill(~incl, 0.0)
    eye = torch.eye(c)
    inv = eye - low
    p2 = low @ low
    for _ in range(3):
        inv = inv + inv @ p2
        p2 = p2 @ p2
    eg = torch.exp(gc)
    last = gc[..., -1:, :]
    w = (k * torch.exp(last - gc) * beta[..., None]).transpose(-1, -2)  # [B,H,N,dk,C]
    dec = torch.exp(last).transpose(-1, -2)  # [B,H,N,dk,1]
    # U = (I + A)^-1 (V - (eg*K) S): both products done for every chunk up front
    av, ak = inv @ v, inv @ (eg * k)
    eq = eg * q
    s = q.new_zeros(b_, h_, dk, v.shape[-1])
    outs = []
    for av_j, ak_j, eq_j, m_j, w_j, dec_j in zip(*(x.unbind(2) for x in (av, ak, eq, m, w, dec)), strict=True):
        u = av_j - ak_j @ s
        outs.append(eq_j @ s + m_j @ u)
        s = dec_j * s + w_j @ u
    return torch.stack(outs, 2).reshape(b_, h_, t_, -1)


def forward(cfg: HybridModelConfig, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] for tokens [B, T] (T a multiple of 16), positions from 0."""
    bsz, t = tokens.shape
    eps = cfg.rms_eps
    x = w["embed"][tokens]
    cos, sin = _rope(cfg, t)
    cos, sin = cos[:, None, :], sin[:, None, :]
    h_, dk, dv = cfg.delta_heads, cfg.delta_key_dim, cfg.delta_value_dim
    km1 = cfg.conv_kernel - 1
    for i, kind in enumerate(cfg.layer_types):
        p = "layers.%d." % i
        hh = _rms(x, w[p + "norm1"], eps)
        if kind == "D":
            proj = hh @ w[p + "mixer.w_in"].T
            mixed, graw, braw, z = proj.split((cfg.conv_dim, h_ * dk, h_, h_ * dv), -1)
            full = F.pad(mixed, (0, 0, km1, 0))
            cw = w[p + "mixer.conv_w"]
            conv = full[:, 0:t] * cw[:, 0]
            for j in range(1, cfg.conv_kernel):
                conv = conv + full[:, j : j + t] * cw[:, j]
            qq, kk, vv = F.silu(conv).split((h_ * dk, h_ * dk, h_ * dv), -1)
            qq, kk = qq.view(bsz, t, h_, dk), kk.view(bsz, t, h_, dk)
            qq = qq * torch.rsqrt(qq.pow(2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
            kk = kk * torch.rsqrt(kk.pow(2).sum(-1, keepdim=True) + 1e-6)
            vv = vv.view(bsz, t, h_, dv)
            g = -torch.exp(w[p + "mixer.a_log"])[:, None] * F.softplus(graw + w[p + "mixer.dt_bias"]).view(
                bsz, t, h_, dk
            )
            beta = torch.sigmoid(braw)
            o = _delta_chunks(*(y.transpose(1, 2) for y in (qq, kk, vv, g)), beta.transpose(1, 2)).transpose(
                1, 2
            )  # [B, T, H, dv]
            o = _rms(o, w[p + "mixer.o_norm"], eps) * torch.sigmoid(z.view(bsz, t, h_, dv))
            out = o.reshape(bsz, t, -1) @ w[p + "mixer.w_o"].T
        else:
            nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            qq, kk, vv = (hh @ w[p + "mixer.w_qkv"].T).split((nh * hd, nkv * hd, nkv * hd), -1)
            qq = _apply_rope(qq.view(bsz, t, nh, hd), cos, sin).transpose(1, 2)
            kk = _apply_rope(kk.view(bsz, t, nkv, hd), cos, sin).transpose(1, 2)
            vv = vv.view(bsz, t, nkv, hd).transpose(1, 2)
            rep = nh // nkv
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out = a.transpose(1, 2).reshape(bsz, t, -1) @ w[p + "mixer.w_o"].T
        x = x + out
        gate, up = (_rms(x, w[p + "norm2"], eps) @ w[p + "mlp.w_gate_up"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ w[p + "mlp.w_down"].T
    return _rms(x, w["final_norm"], eps) @ w["lm_head"].T


def native_logits(cfg: HybridModelConfig, weights: dict[str, torch.Tensor], seq: list[int]) -> torch.Tensor:
    """The native engine's prefill logits for one sequence (fp32)."""
    from hybridpd.engine.native.model import HybridModel, Work

    model = HybridModel(cfg, {k: v.detach().float() for k, v in weights.items()}, torch.device("cpu"))
    nblocks = len(seq) // 16 + 1
    shape = (nblocks, 16, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.attn_layers]
    work = Work(torch.tensor(seq), 0, list(range(nblocks)), model.empty_state(), False)
    with torch.inference_mode():
        model.forward([work], caches)
        return model.logits(work.hidden)


def check_native(cfg: HybridModelConfig, weights: dict[str, torch.Tensor], seq: list[int]) -> float:
    with torch.no_grad():
        ours = forward(cfg, weights, torch.tensor([seq]))[0]
    return (ours - native_logits(cfg, weights, seq)).abs().max().item()


# -- data ---------------------------------------------------------------------------------
def token_stream(tok: Tokenizer, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    ids: list[int] = []
    starts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        starts.append(len(ids))
        ids.extend(enc.ids)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long), starts


def batches(stream: torch.Tensor, starts: list[int], bsz: int, ctx: int, rng: random.Random):
    limit = len(stream) - ctx - 1
    doc_starts = [s for s in starts if s < limit]
    while True:
        offs = [rng.choice(doc_starts) if rng.random() < 0.5 else rng.randrange(limit) for _ in range(bsz)]
        chunk = torch.stack([stream[o : o + ctx + 1] for o in offs])
        yield chunk[:, :-1], chunk[:, 1:]


def heldout_nll(cfg: HybridModelConfig, w: dict[str, torch.Tensor], windows: torch.Tensor) -> float:
    with torch.no_grad():
        tot = 0.0
        for i in range(0, len(windows), 8):
            xb = windows[i : i + 8]
            lg = forward(cfg, w, xb[:, :-1])
            tot += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), xb[:, 1:].reshape(-1), reduction="sum").item()
    return tot / (windows.shape[0] * (windows.shape[1] - 1))


def plot(path: Path, steps: list[int], train: list[float], evals: list[tuple[int, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    k = 20
    smooth = [sum(train[max(0, i - k + 1) : i + 1]) / len(train[max(0, i - k + 1) : i + 1]) for i in range(len(train))]
    ax.plot(steps, smooth, label="train (20-step mean)", color="#4c72b0")
    ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="held-out", color="#dd8452")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=640)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ASSETS / "tiny.safetensors")
    ap.add_argument("--check-only", action="store_true", help="only check the forward against the native engine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = TRAINED_CONFIG
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))

    held_stream, _ = token_stream(tok, corpus.heldout_texts())
    n_eval = min(8, len(held_stream) // (args.context + 1))
    held = held_stream[: n_eval * (args.context + 1)].view(n_eval, args.context + 1)
    weights = {k: v.clone().requires_grad_(True) for k, v in init_weights(cfg, TINY_SEED).items()}
    probe = held[0, : args.context - 8].tolist()  # not a multiple of 16: the engine pads
    print("native check (random init): max |logit diff| %.2e" % check_native(cfg, weights, probe[:240]))
    if args.check_only:
        return

    t0 = time.time()
    stream, starts = token_stream(tok, corpus.train_texts())
    print("train tokens %d, held-out tokens %d (%d windows evaluated)" % (len(stream), len(held_stream), n_eval))
    decay = [v for k, v in weights.items() if v.dim() == 2]
    no_decay = [v for k, v in weights.items() if v.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    init_nll = heldout_nll(cfg, weights, held)
    evals = [(0, init_nll)]
    losses, steps = [], []
    data = batches(stream, starts, args.batch, args.context, rng)
    bar = tqdm(range(args.steps), desc="train tiny", mininterval=5)
    for step in bar:
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step)
        x, y = next(data)
        logits = forward(cfg, weights, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(weights.values()), 1.0)
        opt.step()
        losses.append(loss.item())
        steps.append(step + 1)
        bar.set_postfix(loss="%.3f" % loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, heldout_nll(cfg, weights, held)))
            tqdm.write("step %d: train %.3f held-out %.3f" % (step + 1, losses[-1], evals[-1][1]))
    minutes = (time.time() - t0) / 60

    final = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in weights.items()}
    as_fp32 = {k: v.float() for k, v in final.items()}
    bf16_nll = heldout_nll(cfg, as_fp32, held)
    diff = check_native(cfg, as_fp32, probe[:240])
    print("native check (trained, bf16-rounded): max |logit diff| %.2e" % diff)
    save_weights(args.out, final, {"sha256": weights_digest(as_fp32), "args": json.dumps(vars(args), default=str)})
    report = {
        "params": sum(v.numel() for v in weights.values()),
        "train_tokens": len(stream),
        "tokens_seen": args.steps * args.batch * args.context,
        "minutes": round(minutes, 1),
        "threads": args.threads,
        "heldout_nll_init": init_nll,
        "heldout_nll_final_bf16": bf16_nll,
        "heldout_ppl_init": math.exp(init_nll),
        "heldout_ppl_final_bf16": math.exp(bf16_nll),
        "native_max_logit_diff": diff,
        "evals": evals,
        "train_loss_every_50": losses[::50],
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (ROOT / "scripts" / "train_tiny.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(
        ROOT / "scripts" / "train_tiny.png",
        steps,
        losses,
        evals,
        "tiny hybrid LM (%.1fM params, DDDA), %d steps x %d x %d tokens, %.0f min on %d CPU threads"
        % (report["params"] / 1e6, args.steps, args.batch, args.context, minutes, args.threads),
    )
    print(json.dumps({k: v for k, v in report.items() if k not in ("evals", "train_loss_every_50")}, indent=2))
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
