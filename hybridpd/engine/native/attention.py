"""Softmax attention layer (RoPE, GQA) over a paged KV cache.

KV cache of one attention layer::

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    token at position p of a request lives in block block_table[p // bs],
    row p % bs.

Exactness: prefill attends in query tiles of :data:`KERNEL_CHUNK` positions
aligned at absolute multiples of it, and a tile ending at position ``E``
always sees keys ``[0, E)`` (zero-padded and masked past what is computed), so
a tile's arithmetic depends only on its position. Decode attends one query at
a time over keys padded to a multiple of the chunk, the same for plain decode
and EAGLE verification.
"""

from __future__ import annotations

import torch

from hybridpd.engine.native.model_config import KERNEL_CHUNK, HybridModelConfig
from hybridpd.engine.native.ops import Rope, rows_mm


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class AttentionLayer:
    def __init__(self, cfg: HybridModelConfig, weights: dict[str, torch.Tensor], rope: Rope) -> None:
        self.cfg = cfg
        self.w_qkv = weights["w_qkv"]  # [(H + 2*KV) * hd, hidden]
        self.w_o = weights["w_o"]  # [hidden, H * hd]
        self.rope = rope
        self.splits = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        self.scale = cfg.head_dim**-0.5

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, n = self.cfg, x.shape[0]
        q, k, v = rows_mm(x, self.w_qkv).split(self.splits, dim=-1)
        q = self.rope.apply(q.view(n, c.num_heads, c.head_dim), positions)
        k = self.rope.apply(k.view(n, c.num_kv_heads, c.head_dim), positions)
        return q, k, v.view(n, c.num_kv_heads, c.head_dim)

    @staticmethod
    def write(cache: torch.Tensor, block_table: list[int], start: int, values: torch.Tensor) -> None:
        """Store ``values`` ([n, kv, hd]) at positions ``[start, start + n)``."""
        bs = cache.shape[1]
        pos = torch.arange(start, start + values.shape[0])
        blocks = torch.tensor(block_table, dtype=torch.long)[pos // bs]
        cache.view(-1, *cache.shape[2:])[(blocks * bs + pos % bs).to(cache.device)] = values.to(cache.dtype)

    @staticmethod
    def gather(cache: torch.Tensor, block_table: list[int], length: int, padded: int) -> torch.Tensor:
        """Keys/values of positions ``[0, length)``, zero-padded to ``padded`` rows."""
        bs = cache.shape[1]
        nb = -(-length // bs)
        rows = cache[torch.tensor(block_table[:nb], dtype=torch.long, device=cache.device)]
        rows = rows.reshape(-1, *cache.shape[2:])[:length]
        if padded > length:
            rows = torch.cat([rows, rows.new_zeros(padded - length, *rows.shape[1:])])
        return rows

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """``q``: [m, H, hd] at positions ``q_pos``; keys/vals: [L, KV, hd]."""
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        kh = keys.transpose(0, 1).repeat_interleave(rep, 0)  # [H, L, hd]
        vh = vals.transpose(0, 1).repeat_interleave(rep, 0)
        scores = (q.transpose(0, 1) @ kh.transpose(1, 2)).float() * self.scale  # [H, m, L]
        key_pos = torch.arange(keys.shape[0], device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vh.dtype)
        return (probs @ vh).transpose(0, 1)  # [m, H, hd]

    def _store_and_gather(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        caches: tuple[torch.Tensor, torch.Tensor],
        block_table: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache the new K/V at ``[start, end)``; return keys/values ``[0, end)``
        zero-padded to the next multiple of the kernel chunk."""
        end = start + k.shape[0]
        self.write(caches[0], block_table, start, k)
        self.write(caches[1], block_table, start, v)
        span = _round_up(end, KERNEL_CHUNK)
        return self.gather(caches[0], block_table, end, span), self.gather(caches[1], block_table, end, span)

    def prefill_core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        caches: tuple[torch.Tensor, torch.Tensor],
        block_table: list[int],
    ) -> torch.Tensor:
        """Tokens ``[start, start + n)`` (rotated q/k, v); earlier KV must be cached."""
        n, end = q.shape[0], start + q.shape[0]
        keys, vals = self._store_and_gather(k, v, start, caches, block_table)
        outs = []
        for t0 in range(start, end, KERNEL_CHUNK):
            t1 = t0 + KERNEL_CHUNK
            qt = q[t0 - start : t1 - start]
            m = qt.shape[0]
            if m < KERNEL_CHUNK:
                qt = torch.cat([qt, qt.new_zeros(KERNEL_CHUNK - m, *qt.shape[1:])])
            q_pos = torch.arange(t0, t1, device=q.device)
            outs.append(self._attend(qt, keys[:t1], vals[:t1], q_pos)[:m])
        return torch.cat(outs).reshape(n, -1)

    def decode_core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        caches: tuple[torch.Tensor, torch.Tensor],
        block_table: list[int],
    ) -> torch.Tensor:
        """Consecutive tokens ``[start, start + n)``, each attended alone."""
        n = q.shape[0]
        length = start + n
        keys, vals = self._store_and_gather(k, v, start, caches, block_table)
        outs = []
        for i in range(n):
            pos = start + i
            lim = _round_up(pos + 1, KERNEL_CHUNK)
            # keys past pos are masked; rows beyond `length` are zero padding
            kk = keys[:lim]
            vv = vals[:lim]
            if pos + 1 < length:  # later verify tokens' keys must not leak into the padding
                kk = torch.cat([kk[: pos + 1], kk.new_zeros(lim - pos - 1, *kk.shape[1:])])
                vv = torch.cat([vv[: pos + 1], vv.new_zeros(lim - pos - 1, *vv.shape[1:])])
            q_pos = torch.tensor([pos], device=q.device)
            outs.append(self._attend(q[i : i + 1], kk, vv, q_pos))
        return torch.cat(outs).reshape(n, -1)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return rows_mm(attn, self.w_o)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._qkv(x, positions)
