"""The native engine's tensors and compute: weights, paged KV, state slots, forward,
sampling, EAGLE. It is the only part of the engine that holds tensors.

The engine decides what runs (the scheduler's step) and what it means
(postprocess: stops, caching, outputs); the runner does the arithmetic::

    [ScheduledWork] --run--> [RowResult] (tokens, exports, handoff; step.py)

``run`` starts the tensors of each request admitted this step (from the state
slot its hit restores), proposes EAGLE drafts, runs one batched forward, then
per row: writes the snapshots into the slots ``PrefixCache.plan`` reserved
(and keeps their exports until the prompt completes), samples the first token
at the prompt's end (with the handoff of a ``prefill_only`` request), or
verifies a decode row's drafts, trims its tokens at a stop
(``sequence.stop_reason``) and keeps the state after the last accepted one.

Per request it keeps :class:`SeqTensors` (recurrent state, sampling
generator, last target hidden for EAGLE, pending state exports) from its first
step (or ``load_handoff``) until ``drop``.

KV cache, per attention layer: ``(k, v)``, each ``[num_blocks, unit,
kv_heads, head_dim]`` in the engine dtype; block ``b`` of the table holds
positions ``[b * unit, (b + 1) * unit)`` of its request. State slots:
``state_slots.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import KVExport, StateCheckpoint
from hybridpd.engine.native import exports, logits, sampler
from hybridpd.engine.native.attention import AttentionLayer
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.eagle import DraftHead
from hybridpd.engine.native.handoff import Handoff
from hybridpd.engine.native.model import HybridModel, Work
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.sequence import Sequence, stop_reason
from hybridpd.engine.native.state_cache import slots_for
from hybridpd.engine.native.state_slots import StateSlots
from hybridpd.engine.native.step import RowResult, ScheduledWork
from hybridpd.engine.native.weights import load_weights
from hybridpd.errors import ConfigError
from hybridpd.hashing import BlockHash
from hybridpd.model_identity import engine_identity


@dataclass(slots=True)
class SeqTensors:
    delta: list[DeltaState]
    gen: torch.Generator
    last_hidden: torch.Tensor | None = None
    #: the states a running prefill snapshotted (ascending), exported at the prompt's end
    pending_exports: list[StateCheckpoint] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        cfg: HybridPDConfig,
        path: Path,
        unit: int,
        *,
        record_logits: bool = False,
        num_state_slots: int | None = None,
        export_checkpoints: bool = False,
    ) -> None:
        self.device = torch.device(cfg.device)
        self.dtype = torch.float32 if cfg.engine_dtype() == "float32" else torch.bfloat16
        self.mcfg = HybridModelConfig.load(path / "config.json")
        self.model_id = engine_identity(cfg, path)  # the weights' digest, dtype, geometry, ...
        self.export_checkpoints = export_checkpoints
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
        if num_state_slots is None:  # tests pass a count; engines size from the budget
            num_state_slots = slots_for(cfg.state_cache_mb, len(self.model.delta_layers), m)
        self.slots = StateSlots(num_state_slots, len(self.model.delta_layers), m, self.device)
        self.tensors: dict[str, SeqTensors] = {}
        #: rid -> fp32 logits that chose each emitted token (tests compare paths)
        self.logit_log: dict[str, list[torch.Tensor]] | None = {} if record_logits else None

    @property
    def num_delta_layers(self) -> int:
        return len(self.model.delta_layers)

    # -- per-request tensors ---------------------------------------------------------
    def _start(self, seq: Sequence, restored: list[DeltaState] | None = None) -> SeqTensors:
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
    def run(self, scheduled: list[ScheduledWork]) -> list[RowResult]:
        """Run one step: every request's share in one forward, then what each row
        produced (module docstring). Snapshot slots must have been reserved
        (``seq.snapshot_slots``)."""
        for sw in scheduled:  # restores are read before any snapshot is written
            if sw.admitted:
                slot = sw.seq.restore_slot
                self._start(sw.seq, self.slots.read(slot) if slot is not None else None)
        drafts = self._propose(scheduled)
        works: list[Work] = []
        for sw in scheduled:
            seq = sw.seq
            t = self.tensors[seq.rid]
            start = seq.num_computed
            if sw.decode:
                d = drafts.get(seq.rid, ([], None))[0]
                works.append(Work(torch.tensor([seq.token_ids[-1], *d]), start, seq.block_ids, t.delta, True))
            else:
                snap = frozenset(p for p in seq.snapshot_at if start < p <= start + sw.num_tokens)
                tokens = seq.token_ids[start : start + sw.num_tokens]
                works.append(Work(torch.tensor(tokens), start, seq.block_ids, t.delta, False, snap))
        # NOTE: a Work's ``delta`` IS its request's state list: the forward leaves each
        # request's state after its last computed token in place (a decode row's state
        # after every token is in ``work.token_states``; ``_decoded`` keeps the right one)
        self.model.forward(works, self.kv_caches)
        return [
            self._decoded(sw.seq, w, *drafts.get(sw.seq.rid, ([], None))) if sw.decode else self._prefilled(sw, w)
            for sw, w in zip(scheduled, works, strict=True)
        ]

    def _prefilled(self, sw: ScheduledWork, work: Work) -> RowResult:
        """Write a chunk's snapshots; at the prompt's end, sample the first token and
        hand out the exports (and the handoff of a ``prefill_only`` request)."""
        seq = sw.seq
        t = self.tensors[seq.rid]
        if not set(seq.snapshot_slots) <= set(work.snapshots):  # never cache a slot left unwritten
            raise AssertionError(
                "%s: slots reserved at %s, snapshots taken at %s"
                % (seq.rid, sorted(seq.snapshot_slots), sorted(work.snapshots))
            )
        for pos, states in sorted(work.snapshots.items()):
            slot = seq.snapshot_slots.get(pos)
            if slot is not None:
                self.slots.write(slot, states)
            if self.export_checkpoints:
                key = seq.block_hashes[pos // self.unit - 1]
                t.pending_exports.append(
                    exports.export_state(self.model_id, states, pos, key, speculative=pos in seq.placed)
                )
        if seq.num_computed + sw.num_tokens < seq.num_prompt:
            return RowResult()
        assert work.hidden is not None
        last_logits = self.model.logits(work.hidden[-1:])
        self._log_logits(seq.rid, last_logits)
        t.last_hidden = work.hidden[-1].clone()
        sp = seq.request.sampling
        row = last_logits[0]
        chosen = self._processed(seq, row[None], ())[0]
        token = sampler.pick(chosen, sp, t.gen)
        lps = (logits.logprobs_of(row, token, sp.logprobs),) if sp.logprobs is not None else None
        out = RowResult((token,), lps)
        if t.pending_exports:
            # KV is exported now, not at the snapshot: the store needs every full
            # prompt block, including the replay block after the checkpoint that
            # an EAGLE hit drops. One copy serves every checkpoint of the prompt.
            full = seq.num_prompt // self.unit * self.unit
            kv = self.export_kv(seq.block_ids, full, seq.block_hashes[: full // self.unit])
            out.exports = [(kv, state) for state in t.pending_exports]
            t.pending_exports = []
        if seq.prefill_only and stop_reason(seq.request.sampling, self.mcfg.eos_token_id, token, 1) is None:
            out.handoff = Handoff(
                request=seq.request,
                first_token_id=token,
                num_cached_tokens=seq.num_cached,
                kv=exports.export_kv(
                    self.model_id,
                    self.kv_caches,
                    seq.block_ids,
                    seq.num_prompt,
                    seq.block_hashes[: seq.num_prompt // self.unit],
                ),
                state=exports.export_state(self.model_id, t.delta, seq.num_prompt, None),
                draft=exports.export_draft(self.model_id, t.last_hidden, seq.num_prompt),
            )
        return out

    def _decoded(self, seq: Sequence, work: Work, drafts: list[int], draft_probs: torch.Tensor | None) -> RowResult:
        """The tokens a decode row emits (the pending token's successor, then accepted
        drafts and a correction), trimmed at a stop; keeps the state after the last."""
        t = self.tensors[seq.rid]
        assert work.hidden is not None
        raw = self.model.logits(work.hidden)
        sp = seq.request.sampling
        target = self._processed(seq, raw, drafts)
        if drafts:
            emitted = sampler.verify(target, drafts, draft_probs, sp, t.gen)
        else:
            emitted = [sampler.pick(target[0], sp, t.gen)]
        keep = len(emitted)
        for i, tok in enumerate(emitted):
            if stop_reason(sp, self.mcfg.eos_token_id, tok, seq.num_output + i + 1) is not None:
                keep = i + 1
                break
        self._log_logits(seq.rid, raw[:keep])
        accepted = len(emitted) - 1  # the target computed the pending token + this many drafts
        t.delta = work.token_states[accepted]
        t.last_hidden = work.hidden[accepted].clone()
        lps = None
        if sp.logprobs is not None:  # row i chose emitted token i
            lps = tuple(logits.logprobs_of(raw[i], tok, sp.logprobs) for i, tok in enumerate(emitted[:keep]))
        return RowResult(tuple(emitted[:keep]), lps, len(drafts), len(emitted))

    def _processed(self, seq: Sequence, rows: torch.Tensor, drafts: list[int] | tuple[()]) -> torch.Tensor:
        """``rows`` (the target's logits for the next token, then after each draft) through
        the request's logits processors (``logits.process``): row ``i`` follows the output
        so far plus ``drafts[:i]``, the history it has if those drafts are accepted (a row
        is used only then). Unchanged when the request processes nothing."""
        sp = seq.request.sampling
        if not sp.processes_logits:
            return rows
        prompt = seq.token_ids[: seq.num_prompt]
        output = seq.token_ids[seq.num_prompt :]
        eos = self.mcfg.eos_token_id
        return torch.stack(
            [logits.process(rows[i], sp, prompt, [*output, *drafts[:i]], eos) for i in range(rows.shape[0])]
        )

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

    def _log_logits(self, rid: str, rows: torch.Tensor) -> None:
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

    def export_kv(self, block_ids: list[int], length: int, block_hashes: list[BlockHash] | tuple[()] = ()) -> KVExport:
        return exports.export_kv(self.model_id, self.kv_caches, block_ids, length, block_hashes)

    def check_handoff(self, handoff: Handoff, n: int) -> None:
        """IntegrityError unless ``handoff`` is ``n`` prompt tokens of this model."""
        kv_shapes, st_shapes = self.expected_shapes(n)
        exports.check_meta(handoff.kv.meta, self.model_id, "kv", kv_shapes)
        exports.check_meta(handoff.state.meta, self.model_id, "state", st_shapes)
        exports.check_meta(handoff.draft.meta, self.model_id, "draft", [(self.mcfg.hidden_size,)])

    def load_handoff(self, seq: Sequence, handoff: Handoff, held: frozenset[int] = frozenset()) -> None:
        """Write ``handoff``'s KV into ``seq``'s blocks, but blocks ``held`` (already
        there: a delta handoff), and start its tensors from its state and draft
        hidden (metas already checked)."""
        n, u = seq.num_prompt, self.unit
        start = 0
        for b in [*sorted(held), -(-n // u)]:  # runs of blocks between held ones
            if b > start:
                exports.import_kv(handoff.kv, self.kv_caches, seq.block_ids, start * u, min(b * u, n))
            start = b + 1
        t = self._start(seq, exports.import_state(handoff.state, self.device))
        t.last_hidden = handoff.draft.buffers[0].to(self.device).clone()

    def write_kv_block(self, block: int, index: int, kv: KVExport) -> None:
        """Write rows ``[index * unit, (index + 1) * unit)`` of ``kv`` into ``block``."""
        table = [block] * (index + 1)  # only entry ``index`` is used by the write
        rows = slice(index * self.unit, (index + 1) * self.unit)
        for li, (k_cache, v_cache) in enumerate(self.kv_caches):
            AttentionLayer.write(k_cache, table, index * self.unit, kv.buffers[2 * li][rows])
            AttentionLayer.write(v_cache, table, index * self.unit, kv.buffers[2 * li + 1][rows])

    def write_state(self, slot: int, state: StateCheckpoint) -> None:
        """Write an imported checkpoint's states into ``slot`` (metas already checked)."""
        self.slots.write(slot, exports.import_state(state, self.device))
