"""Numeric building blocks, written for exactness across execution paths.

NOTE: with torch's CPU kernels (MKL) an fp32 matmul row's result is
bit-identical for every M >= 16 rows and every row slot, but M < 16 takes
other kernels and differs in the last bits. :func:`rows_mm` therefore pads to
16 rows, so a token's numbers never depend on how many other tokens share its
batch, chunk or step (batch invariance, checked by tests). bf16 does NOT have
the property (oneDNN's AMX kernels differ with M), so bf16 paths are compared
with a tolerance.
:func:`row_invariance_problem` checks the property on the machine at hand:
the exactness tests (equal greedy tokens, logits within 1e-4 or
``torch.equal``, as each says) run only where it holds (else they skip,
saying why, and ``.ci/run`` fails if they skip where it holds), so no
verdict depends on the CPU model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 16


def rows_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with at least :data:`MIN_ROWS` rows computed."""
    n = x.shape[0]
    if n >= MIN_ROWS:
        return x @ weight.T
    pad = x.new_zeros((MIN_ROWS - n, x.shape[1]))
    return (torch.cat([x, pad]) @ weight.T)[:n]


def row_invariance_problem(dtype: torch.dtype = torch.float32) -> str | None:
    """``None`` if :func:`rows_mm` is row-invariant here for ``dtype`` (a row's
    result does not depend on M >= 16, on its slot, or on the thread count),
    else what differed. Checked on the tiny models' weight shapes."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for k, n in ((256, 512), (512, 256), (256, 2048), (256, 768), (512, 1024)):
            w = torch.randn(n, k, generator=gen).to(dtype)
            x = torch.randn(2048, k, generator=gen).to(dtype)
            ref = rows_mm(x[:MIN_ROWS], w)
            for t in sorted({1, threads}):
                torch.set_num_threads(t)
                for m in (1, 5, 16, 17, 31, 48, 64, 100, 256, 320, 512, 1000, 2048):  # up to the budgets tests use
                    got = rows_mm(x[:m], w)
                    if not torch.equal(got[: min(m, MIN_ROWS)], ref[: min(m, MIN_ROWS)]):
                        return "rows of M=%d differ from M=%d (%dx%d weight, %s, %d threads)" % (
                            m,
                            MIN_ROWS,
                            k,
                            n,
                            dtype,
                            t,
                        )
                for slot in (1, 7, 15, 40):
                    xs = torch.cat([x[100 : 100 + slot], x[:1], x[200 : 200 + max(0, MIN_ROWS - 1 - slot)]])
                    if not torch.equal(rows_mm(xs, w)[slot], ref[0]):
                        return "row slot %d differs (%dx%d weight, %s, %d threads)" % (slot, k, n, dtype, t)
    finally:
        torch.set_num_threads(threads)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = rows_mm(x, w_gate_up).chunk(2, dim=-1)
    return rows_mm(F.silu(gate) * up, w_down)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class Rope:
    """Rotary embedding tables (rotate-half convention)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device) -> None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        ang = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv[None, :]
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).float()
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).float()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x``: [n, heads, head_dim]; ``positions``: [n]."""
        cos = self.cos[positions][:, None, :].to(x.dtype)
        sin = self.sin[positions][:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU.

    ``x``: [n, dim]; ``state``: [K-1, dim] (the K-1 inputs before x[0]);
    ``weight``: [dim, K]. Returns ``(out [n, dim], full [n+K-1, dim])``;
    ``full[j : j+K-1]`` is the conv state after ``j`` of these tokens.
    The sum runs tap by tap in a fixed order, so prefill and decode agree.
    """
    k = weight.shape[1]
    n = x.shape[0]
    full = torch.cat([state, x])
    out = full[0:n] * weight[:, 0]
    for j in range(1, k):
        out = out + full[j : j + n] * weight[:, j]
    return F.silu(out), full
