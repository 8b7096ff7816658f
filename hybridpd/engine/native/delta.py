"""Gated delta rule layer, KDA style (per-channel forget gate).

Recurrence per head, state ``S`` in ``R^{dk x dv}``::

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T      o_t = S_t^T q_t

with ``a_t = exp(g_t)`` (per key channel), ``b_t = sigmoid``, ``q, k``
L2-normalised after a short causal conv, and an output gate
``o = rmsnorm(o) * sigmoid(z)``.

Prefill runs the chunked (WY) form on chunks of :data:`KERNEL_CHUNK` tokens
that start at absolute multiples of the chunk, so the same chunks (and the
same arithmetic) occur whatever the token budget or cache hit. The state is
available at every chunk boundary: that is where checkpoints are exported.
A partial last chunk is zero-padded with ``b = 0, g = 0``, which leaves the
state exactly unchanged. Decode runs the recurrent form, token by token
(EAGLE verification included), so decode and verification run the same
arithmetic (the EAGLE tests compare their greedy tokens with plain decoding).

Within a chunk of C tokens starting from state ``S0``, with ``G_t`` the
cumulative log-decay and ``D_ti = exp(G_t - G_i)`` (per channel, i <= t)::

    A_ti = b_i <k_t, D_ti k_i>  (i < t)      M_ti = b_i <q_t, D_ti k_i>  (i <= t)
    U    = (I + A)^-1 (V - (exp(G) * K) S0)
    O    = (exp(G) * Q) S0 + M U
    S_C  = exp(G_C) * S0 + (b * exp(G_C - G) * K)^T U
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridpd.engine.native.model_config import KERNEL_CHUNK, HybridModelConfig
from hybridpd.engine.native.ops import causal_conv, l2_normalize, rms_norm, rows_mm


@dataclass(slots=True)
class DeltaState:
    """Recurrent state of one layer for one sequence (fp32)."""

    conv: torch.Tensor  # [K-1, conv_dim]
    ssm: torch.Tensor  # [heads, dk, dv]

    def clone(self) -> DeltaState:
        return DeltaState(self.conv.clone(), self.ssm.clone())


class DeltaLayer:
    """Weights and math of one gated-delta layer (no module state)."""

    def __init__(self, cfg: HybridModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w_in = weights["w_in"]  # [conv_dim + H*dk + H + H*dv, hidden]
        self.conv_w = weights["conv_w"]  # [conv_dim, K]
        self.a_log = weights["a_log"]  # [H]
        self.dt_bias = weights["dt_bias"]  # [H*dk]
        self.o_norm = weights["o_norm"]  # [dv]
        self.w_o = weights["w_o"]  # [hidden, H*dv]
        h, dk, dv = cfg.delta_heads, cfg.delta_key_dim, cfg.delta_value_dim
        self.splits = (cfg.conv_dim, h * dk, h, h * dv)
        self.qkv_splits = (h * dk, h * dk, h * dv)

    def empty_state(self, device: torch.device) -> DeltaState:
        c = self.cfg
        return DeltaState(
            torch.zeros(c.conv_kernel - 1, c.conv_dim, device=device),
            torch.zeros(c.delta_heads, c.delta_key_dim, c.delta_value_dim, device=device),
        )

    # -- projections, batched over every request's rows ------------------------------
    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Input projection of all rows of a step (row-exact, so batchable)."""
        return rows_mm(x, self.w_in).float()

    def output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated norm + output projection of all rows of a step."""
        n = o.shape[0]
        o = rms_norm(o, self.o_norm.float(), self.cfg.rms_eps) * torch.sigmoid(z.view(n, self.cfg.delta_heads, -1))
        return rows_mm(o.reshape(n, -1).to(dtype), self.w_o)

    def _split(self, proj: torch.Tensor, conv_state: torch.Tensor):
        c = self.cfg
        h, dk, dv = c.delta_heads, c.delta_key_dim, c.delta_value_dim
        mixed, graw, braw, z = proj.split(self.splits, dim=-1)
        conv_out, full = causal_conv(mixed, conv_state, self.conv_w.float())
        q, k, v = conv_out.split(self.qkv_splits, dim=-1)
        n = proj.shape[0]
        q = l2_normalize(q.view(n, h, dk)) * dk**-0.5
        k = l2_normalize(k.view(n, h, dk))
        v = v.view(n, h, dv)
        g = -torch.exp(self.a_log.float())[:, None] * F.softplus(graw + self.dt_bias.float()).view(n, h, dk)
        beta = torch.sigmoid(braw)
        return q, k, v, g, beta, z, full

    # -- prefill: chunked form ---------------------------------------------------
    def prefill_core(
        self, proj: torch.Tensor, start: int, state: DeltaState, snapshot_at: frozenset[int] = frozenset()
    ) -> tuple[torch.Tensor, torch.Tensor, DeltaState, dict[int, DeltaState]]:
        """Compute tokens ``[start, start + n)`` (projected rows) from ``state``.

        ``start`` must be a multiple of the kernel chunk. Returns the
        pre-output ``o`` and gate ``z``, the state after the last token, and
        the states at the requested positions (chunk boundaries in range).
        """
        if start % KERNEL_CHUNK:
            raise ValueError("prefill must start at a multiple of %d, got %d" % (KERNEL_CHUNK, start))
        n = proj.shape[0]
        q, k, v, g, beta, z, full = self._split(proj, state.conv)
        km1 = self.cfg.conv_kernel - 1
        s = state.ssm
        outs = []
        snaps: dict[int, DeltaState] = {}
        for c0 in range(0, n, KERNEL_CHUNK):
            c1 = min(c0 + KERNEL_CHUNK, n)
            o, s = _chunk(q[c0:c1], k[c0:c1], v[c0:c1], g[c0:c1], beta[c0:c1], s)
            outs.append(o)
            pos = start + c1
            if pos in snapshot_at:
                snaps[pos] = DeltaState(full[c1 : c1 + km1].clone(), s.clone())
        return torch.cat(outs), z, DeltaState(full[n : n + km1].clone(), s), snaps

    # -- decode: recurrent form -------------------------------------------------
    def decode_core(self, proj: torch.Tensor, state: DeltaState) -> tuple[torch.Tensor, torch.Tensor, list[DeltaState]]:
        """Compute ``n`` consecutive tokens one by one; returns ``o``, ``z`` and
        the state after each token (EAGLE rolls back to one of them)."""
        q, k, v, g, beta, z, full = self._split(proj, state.conv)
        km1 = self.cfg.conv_kernel - 1
        s = state.ssm
        outs, states = [], []
        for t in range(proj.shape[0]):
            s = torch.exp(g[t])[:, :, None] * s
            u = v[t] - torch.einsum("hk,hkv->hv", k[t], s)
            s = s + beta[t][:, None, None] * k[t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t], s))
            states.append(DeltaState(full[t + 1 : t + 1 + km1].clone(), s))
        return torch.stack(outs), z, states

    # -- single-request conveniences (tests, tools) ---------------------------------
    def prefill(
        self, x: torch.Tensor, start: int, state: DeltaState, snapshot_at: frozenset[int] = frozenset()
    ) -> tuple[torch.Tensor, DeltaState, dict[int, DeltaState]]:
        o, z, new_state, snaps = self.prefill_core(self.project(x), start, state, snapshot_at)
        return self.output(o, z, x.dtype), new_state, snaps

    def decode(self, x: torch.Tensor, state: DeltaState) -> tuple[torch.Tensor, list[DeltaState]]:
        o, z, states = self.decode_core(self.project(x), state)
        return self.output(o, z, x.dtype), states


def _chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (<= KERNEL_CHUNK tokens, zero-padded to it). Inputs are
    [C, H, *]; ``s0`` is [H, dk, dv]. Returns ``(O [C, H, dv], S_C)``."""
    n = q.shape[0]
    if n < KERNEL_CHUNK:
        pad = KERNEL_CHUNK - n
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    q, k, v, g = (t.transpose(0, 1) for t in (q, k, v, g))  # [H, C, *]
    b = beta.transpose(0, 1)  # [H, C]
    gc = g.cumsum(1)
    c = KERNEL_CHUNK
    lower_incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = gc[:, :, None, :] - gc[:, None, :, :]  # [H, t, i, dk]
    decay = torch.exp(diff.masked_fill(~lower_incl[None, :, :, None], float("-inf")))
    kd = decay * k[:, None, :, :]  # D_ti * k_i
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    a = torch.einsum("htc,htic->hti", k, kd) * b[:, None, :]
    a = a.masked_fill(~strict[None], 0.0) + torch.eye(c, device=q.device)  # I + strictly-lower A
    m = torch.einsum("htc,htic->hti", q, kd) * b[:, None, :]
    eg = torch.exp(gc)
    rhs = v - (eg * k) @ s0
    u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    o = (eg * q) @ s0 + m @ u
    last = gc[:, -1:, :]  # [H, 1, dk]
    w = k * torch.exp(last - gc) * b[:, :, None]
    s_new = torch.exp(last).transpose(1, 2) * s0 + w.transpose(1, 2) @ u
    return o.transpose(0, 1)[:n], s_new
