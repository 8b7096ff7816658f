"""The native engine's tensors and compute: weights, paged KV, forward, sampling, EAGLE.

The engine (``engine.py``) decides what runs (the scheduler's step) and what
it means (outputs, stops, checkpoints); the runner does the arithmetic::

    scheduled step --execute--> [StepRow: Work (hidden, snapshots, token
                                 states) + EAGLE drafts] per request
    prefill row at the prompt's end --sample_first--> first token
    decode row --verify--> emitted tokens --accept--> state at the last accepted token

Per request it keeps :class:`SeqTensors` (recurrent state, sampling
generator, last target hidden for EAGLE) from ``start`` until ``drop``.

KV cache, per attention layer: ``(k, v)``, each ``[num_blocks, unit,
kv_heads, head_dim]`` in the engine dtype; block ``b`` of the table holds
positions ``[b * unit, (b + 1) * unit)`` of its request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import KVExport
from hybridpd.engine.native import exports, sampler
from hybridpd.engine.native.attention import AttentionLayer
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.eagle import DraftHead
from hybridpd.engine.native.handoff import Handoff
from hybridpd.engine.native.model import HybridModel, Work
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.scheduler import ScheduledWork
from hybridpd.engine.native.sequence import Sequence
from hybridpd.engine.native.weights import load_weights
from hybridpd.errors import ConfigError
from hybridpd.hashing import BlockHash


@dataclass(slots=True)
class SeqTensors:
    delta: list[DeltaState]
    gen: torch.Generator
    last_hidden: torch.Tensor | None = None


@dataclass(slots=True)
class StepRow:
    """One request's share of an executed step."""

    work: Work
    #: EAGLE drafts the target verified in this decode row (empty: none)
    drafts: list[int]
    #: their draft distributions when sampling (rejection sampling needs them)
    draft_probs: torch.Tensor | None


class ModelRunner:
    def __init__(self, cfg: HybridPDConfig, path: Path, unit: int, record_logits: bool = False) -> None:
        self.device = torch.device(cfg.device)
        self.dtype = torch.float32 if cfg.engine_dtype() == "float32" else torch.bfloat16
        self.mcfg = HybridModelConfig.load(path / "config.json")
        weights = load_weights(path / "model.safetensors", self.dtype, self.device)
        self.model = HybridModel(self.mcfg, weights, self.device)
        self.draft: DraftHead | None = None
        if cfg.eagle:
            if not (path / "draft.safetensors").exists():
                raise ConfigError("eagle", "model %s has no draft.safetensors (EAGLE head)" % path)
            self.draft = DraftHead(self.model, load_weights(path / "draft.safetensors", self.dtype, self.device))
        self.unit = unit
        m = self.mcfg
        shape = (cfg.num_kv_blocks, unit, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in self.model.attn_layers
        ]
        self.tensors: dict[str, SeqTensors] = {}
        #: rid -> fp32 logits that chose each emitted token (tests compare paths)
        self.logit_log: dict[str, list[torch.Tensor]] | None = {} if record_logits else None

    @property
    def num_delta_layers(self) -> int:
        return len(self.model.delta_layers)

    # -- per-request tensors ---------------------------------------------------------
    def start(self, seq: Sequence, restored: list[DeltaState] | None = None) -> SeqTensors:
        """Tensors of a request entering its first step (from a restored state, or empty)."""
        gen = torch.Generator(device="cpu")
        seed = seq.request.sampling.seed
        gen.manual_seed(seed if seed is not None else uuid.uuid4().int & ((1 << 63) - 1))
        t = SeqTensors(restored if restored is not None else self.model.empty_state(), gen)
        self.tensors[seq.rid] = t
        return t

    def drop(self, rid: str) -> None:
        self.tensors.pop(rid, None)

    # -- the step --------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledWork]) -> list[StepRow]:
        """Propose EAGLE drafts, then run every request's share of the step in one
        forward. Every scheduled request must have been ``start``ed.

        NOTE: a Work's ``delta`` IS its request's state list: the forward leaves
        each request's state after its last computed token in place (a decode
        row's state after every token is in ``work.token_states``; ``accept``
        picks the one of the last accepted token)."""
        drafts = self._propose(scheduled)
        rows: list[StepRow] = []
        for sw in scheduled:
            seq = sw.seq
            t = self.tensors[seq.rid]
            start = seq.num_computed
            d, dp = drafts.get(seq.rid, ([], None))
            if sw.decode:
                work = Work(torch.tensor([seq.token_ids[-1], *d]), start, seq.block_ids, t.delta, True)
            else:
                snap = frozenset(p for p in seq.snapshot_at if start < p <= start + sw.num_tokens)
                tokens = seq.token_ids[start : start + sw.num_tokens]
                work = Work(torch.tensor(tokens), start, seq.block_ids, t.delta, False, snap)
            rows.append(StepRow(work, d, dp))
        self.model.forward([r.work for r in rows], self.kv_caches)
        return rows

    def _propose(self, scheduled: list[ScheduledWork]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """EAGLE drafts for every decoding request of the step, in one batch."""
        if self.draft is None:
            return {}
        rows = []
        for sw in scheduled:
            seq = sw.seq
            t = self.tensors[seq.rid]
            left = seq.request.sampling.max_tokens - seq.num_output
            if sw.decode and left > 1 and t.last_hidden is not None:
                rows.append((seq, t, min(sw.num_tokens - 1, left - 1)))
        if not rows:
            return {}
        got = self.draft.propose(
            [seq.token_ids[-1] for seq, _, _ in rows],
            torch.stack([t.last_hidden for _, t, _ in rows]),  # type: ignore[misc]
            [k for _, _, k in rows],
            [seq.request.sampling for seq, _, _ in rows],
            [t.gen for _, t, _ in rows],
        )
        return {seq.rid: g for (seq, _, _), g in zip(rows, got, strict=True)}

    def sample_first(self, seq: Sequence, work: Work) -> int:
        """The token after the prompt, from the last row of its final prefill chunk."""
        t = self.tensors[seq.rid]
        assert work.hidden is not None
        last_logits = self.model.logits(work.hidden[-1:])
        self.log_logits(seq.rid, last_logits)
        t.last_hidden = work.hidden[-1].clone()
        return sampler.pick(last_logits[0], seq.request.sampling, t.gen)

    def verify(self, seq: Sequence, row: StepRow) -> tuple[list[int], torch.Tensor]:
        """The tokens a decode row emits (the pending token's successor, then
        accepted drafts and a correction) and the target logits of each row."""
        t = self.tensors[seq.rid]
        assert row.work.hidden is not None
        logits = self.model.logits(row.work.hidden)
        sp = seq.request.sampling
        if row.drafts:
            return sampler.verify(logits, row.drafts, row.draft_probs, sp, t.gen), logits
        return [sampler.pick(logits[0], sp, t.gen)], logits

    def accept(self, rid: str, row: StepRow, accepted: int) -> None:
        """Keep the state after the pending token and ``accepted`` drafts."""
        t = self.tensors[rid]
        assert row.work.hidden is not None
        t.delta = row.work.token_states[accepted]
        t.last_hidden = row.work.hidden[accepted].clone()

    def log_logits(self, rid: str, rows: torch.Tensor) -> None:
        if self.logit_log is not None:
            self.logit_log.setdefault(rid, []).extend(r.clone() for r in rows)

    # -- buffers in and out ----------------------------------------------------------
    def expected_shapes(self, n: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Buffer shapes of ``n`` tokens of KV, and of one recurrent state."""
        m = self.mcfg
        kv: list[tuple[int, ...]] = [(n, m.num_kv_heads, m.head_dim)] * (2 * len(self.model.attn_layers))
        st: list[tuple[int, ...]] = []
        for _ in self.model.delta_layers:
            st += [(m.conv_kernel - 1, m.conv_dim), (m.delta_heads, m.delta_key_dim, m.delta_value_dim)]
        return kv, st

    def export_kv(
        self, model_id: str, block_ids: list[int], length: int, block_hashes: list[BlockHash] | tuple[()] = ()
    ) -> KVExport:
        return exports.export_kv(model_id, self.kv_caches, block_ids, length, block_hashes)

    def make_handoff(self, model_id: str, seq: Sequence, token: int) -> Handoff:
        """Owned copies of what decode needs after ``seq``'s prompt and first ``token``."""
        t = self.tensors[seq.rid]
        assert t.last_hidden is not None
        n = seq.num_prompt
        return Handoff(
            request=seq.request,
            first_token_id=token,
            num_cached_tokens=seq.num_cached,
            kv=exports.export_kv(model_id, self.kv_caches, seq.block_ids, n),
            state=exports.export_state(model_id, t.delta, n, None),
            draft=exports.export_draft(model_id, t.last_hidden, n),
        )

    def check_handoff(self, model_id: str, handoff: Handoff, n: int) -> None:
        """IntegrityError unless ``handoff`` is ``n`` prompt tokens of this model."""
        kv_shapes, st_shapes = self.expected_shapes(n)
        exports.check_meta(handoff.kv.meta, model_id, "kv", kv_shapes)
        exports.check_meta(handoff.state.meta, model_id, "state", st_shapes)
        exports.check_meta(handoff.draft.meta, model_id, "draft", [(self.mcfg.hidden_size,)])

    def load_handoff(self, seq: Sequence, handoff: Handoff) -> None:
        """Write ``handoff``'s KV into ``seq``'s blocks and start its tensors from its
        state and draft hidden (metas already checked)."""
        exports.import_kv(handoff.kv, self.kv_caches, seq.block_ids)
        t = self.start(seq, exports.import_state(handoff.state, self.device))
        t.last_hidden = handoff.draft.buffers[0].to(self.device).clone()

    def write_kv_block(self, block: int, index: int, kv: KVExport) -> None:
        """Write rows ``[index * unit, (index + 1) * unit)`` of ``kv`` into ``block``."""
        table = [block] * (index + 1)  # only entry ``index`` is used by the write
        rows = slice(index * self.unit, (index + 1) * self.unit)
        for li, (k_cache, v_cache) in enumerate(self.kv_caches):
            AttentionLayer.write(k_cache, table, index * self.unit, kv.buffers[2 * li][rows])
            AttentionLayer.write(v_cache, table, index * self.unit, kv.buffers[2 * li + 1][rows])
