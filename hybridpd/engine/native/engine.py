"""NativeEngine: the reference implementation of the engine protocol.

Owns the model, the paged KV cache, the state-checkpoint slots and the
scheduler; ``step()`` runs one continuous-batching step. See
``hybridpd.engine.base`` for the request lifecycle and the export objects.

Exactness rules (tests compare paths token for token):

* prefill chunks and attention tiles sit at absolute multiples of 16, so a
  budget, a cache hit or an import never changes a token's arithmetic;
* restored state is the exact tensor that was saved;
* KV computed by decode is never entered into the prefix cache: decode runs
  the recurrent form, whose last bits differ from the chunked prefill form,
  and a later prefill hitting it would no longer match a full recompute.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridpd.checkpoints import checkpoint_slot_column, natural_position, needs_rekey
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import (
    EngineRequest,
    FinishReason,
    Handoff,
    KVExport,
    PoolStats,
    RequestId,
    RequestOutput,
    StateCheckpoint,
)
from hybridpd.engine.native import exports, sampler
from hybridpd.engine.native.attention import AttentionLayer
from hybridpd.engine.native.block_pool import BlockPool
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.eagle import DraftHead
from hybridpd.engine.native.model import HybridModel, Work
from hybridpd.engine.native.model_config import KERNEL_CHUNK, HybridModelConfig
from hybridpd.engine.native.scheduler import ScheduledWork, Scheduler, SchedulerConfig, SeqStatus, Sequence
from hybridpd.engine.native.tiny import resolve_model_dir
from hybridpd.engine.native.weights import load_weights
from hybridpd.errors import ConfigError, IntegrityError, InvalidRequestError, OverloadedError
from hybridpd.hashing import BlockHasher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SeqTensors:
    delta: list[DeltaState]
    gen: torch.Generator
    last_hidden: torch.Tensor | None = None


@dataclass(slots=True)
class SpecStats:
    steps: int = 0
    emitted: int = 0
    #: tokens emitted by each verification step since the last drain (metrics)
    recent: list[int] = field(default_factory=list)

    def drain(self) -> list[int]:
        out, self.recent = self.recent, []
        return out

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class NativeEngine:
    #: checkpoints from the store can be imported (and cached blocks published by us)
    imports_checkpoints = True

    def __init__(
        self,
        cfg: HybridPDConfig,
        *,
        num_state_slots: int = 128,
        export_checkpoints: bool = False,
        model_dir: Path | None = None,
        record_logits: bool = False,
    ) -> None:
        if cfg.checkpoint_alignment is not None and cfg.checkpoint_alignment % KERNEL_CHUNK:
            raise ConfigError(
                "checkpoint_alignment",
                "the native engine exports state at multiples of %d; got %d" % (KERNEL_CHUNK, cfg.checkpoint_alignment),
            )
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        dtype = torch.float32 if cfg.engine_dtype() == "float32" else torch.bfloat16
        path = model_dir or resolve_model_dir(cfg.model)
        self.mcfg = HybridModelConfig.load(path / "config.json")
        self.model_id = "%s@%s" % (path.name, self.mcfg.hidden_size)
        self.model = HybridModel(self.mcfg, load_weights(path / "model.safetensors", dtype, self.device), self.device)
        self.draft: DraftHead | None = None
        if cfg.eagle:
            if not (path / "draft.safetensors").exists():
                raise ConfigError("eagle", "model %s has no draft.safetensors (EAGLE head)" % path)
            self.draft = DraftHead(self.model, load_weights(path / "draft.safetensors", dtype, self.device))
        self.unit = cfg.prefix_match_unit
        self.hasher = BlockHasher(unit=self.unit, algo=cfg.hash_algo, seed=cfg.hash_seed)
        m = self.mcfg
        shape = (cfg.num_kv_blocks, self.unit, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in self.model.attn_layers
        ]
        n_delta = len(self.model.delta_layers)
        self.slot_conv = torch.zeros(num_state_slots, n_delta, m.conv_kernel - 1, m.conv_dim, device=self.device)
        self.slot_ssm = torch.zeros(
            num_state_slots, n_delta, m.delta_heads, m.delta_key_dim, m.delta_value_dim, device=self.device
        )
        self.kv_pool = BlockPool(cfg.num_kv_blocks)
        self.state_pool = BlockPool(num_state_slots)
        self.scheduler = Scheduler(
            SchedulerConfig(
                unit=self.unit,
                mamba_block_size=cfg.mamba_block_size,
                alignment=cfg.checkpoint_alignment,
                eagle=cfg.eagle,
                num_spec=cfg.num_speculative_tokens,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                enable_caching=cfg.enable_prefix_caching,
            ),
            self.kv_pool,
            self.state_pool,
        )
        self.export_checkpoints = export_checkpoints
        self.exports: list[tuple[KVExport, StateCheckpoint]] = []
        self.pending_exports: dict[str, StateCheckpoint] = {}
        self.handoffs: dict[str, Handoff] = {}
        self.seqs: dict[str, Sequence] = {}
        self.tensors: dict[str, _SeqTensors] = {}
        self.pending: list[RequestOutput] = []
        self.spec = SpecStats()
        #: rid -> fp32 logits that chose each emitted token (tests compare paths)
        self.logit_log: dict[str, list[torch.Tensor]] | None = {} if record_logits else None

    # -- requests ------------------------------------------------------------------
    def _validate(self, request: EngineRequest) -> None:
        p, sp = request.prompt_token_ids, request.sampling
        if not p:
            raise InvalidRequestError("prompt must contain at least one token")
        if min(p) < 0 or max(p) >= self.mcfg.vocab_size:
            raise InvalidRequestError("token ids must lie in [0, %d)" % self.mcfg.vocab_size)
        if sp.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1")
        if len(p) + sp.max_tokens > self.cfg.max_model_len:
            raise InvalidRequestError(
                "prompt (%d) + max_tokens (%d) exceeds max_model_len %d"
                % (len(p), sp.max_tokens, self.cfg.max_model_len)
            )
        if request.request_id in self.seqs:
            raise InvalidRequestError("duplicate request id %s" % request.request_id)

    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        """Queue ``request``. With ``prefill_only`` it finishes after its first
        token and leaves a :class:`Handoff` in ``self.handoffs``."""
        self._validate(request)
        prompt = list(request.prompt_token_ids)
        seq = Sequence(
            request,
            prompt,
            len(prompt),
            self.hasher.chain(prompt, cache_salt=request.cache_salt),
            prefill_only=prefill_only,
        )
        if self.scheduler.blocks_needed(seq) > self.kv_pool.num_slots:
            raise InvalidRequestError(
                "request needs %d KV blocks; the engine has %d"
                % (self.scheduler.blocks_needed(seq), self.kv_pool.num_slots)
            )
        self.seqs[seq.rid] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: RequestId | str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq)
        self.pending.append(
            RequestOutput(seq.request.request_id, (), True, FinishReason.ABORT, seq.num_prompt, seq.num_cached)
        )
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.pending)

    def _finish(self, seq: Sequence) -> None:
        self.pending_exports.pop(seq.rid, None)
        self.scheduler.finish(seq)
        self.seqs.pop(seq.rid, None)
        self.tensors.pop(seq.rid, None)

    # -- the step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        works: list[Work] = []
        drafts = self._propose(scheduled)
        for sw in scheduled:
            seq = sw.seq
            t = self.tensors[seq.rid]
            start = seq.num_computed
            if sw.decode:
                tokens = [seq.token_ids[-1], *drafts.get(seq.rid, ([], None))[0]]
                works.append(Work(torch.tensor(tokens), start, seq.block_ids, t.delta, True))
            else:
                cp = seq.checkpoint_pos
                snap = frozenset({cp}) if cp is not None and start < cp <= start + sw.num_tokens else frozenset()
                tokens = seq.token_ids[start : start + sw.num_tokens]
                works.append(Work(torch.tensor(tokens), start, seq.block_ids, t.delta, False, snap))
        self.model.forward(works, self.kv_caches)
        for sw, work in zip(scheduled, works, strict=True):
            d, dp = drafts.get(sw.seq.rid, ([], None))
            out = self._after_decode(sw.seq, work, d, dp) if sw.decode else self._after_prefill(sw.seq, work)
            if out is not None:
                outputs.append(out)
        return outputs

    def _propose(self, scheduled: list[ScheduledWork]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """EAGLE drafts for every decoding request of the step, in one batch."""
        for sw in scheduled:
            if sw.seq.rid not in self.tensors:
                self._start(sw.seq)
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

    def _start(self, seq: Sequence) -> _SeqTensors:
        if seq.restore_slot is not None:
            s = seq.restore_slot
            delta = [
                DeltaState(self.slot_conv[s, i].clone(), self.slot_ssm[s, i].clone())
                for i in range(len(self.model.delta_layers))
            ]
        else:
            delta = self.model.empty_state()
        gen = torch.Generator(device="cpu")
        seed = seq.request.sampling.seed
        gen.manual_seed(seed if seed is not None else uuid.uuid4().int & ((1 << 63) - 1))
        t = _SeqTensors(delta, gen)
        self.tensors[seq.rid] = t
        return t

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        sp = seq.request.sampling
        if token in sp.stop_token_ids or (token == self.mcfg.eos_token_id and not sp.ignore_eos):
            return FinishReason.STOP
        if seq.num_output >= sp.max_tokens:
            return FinishReason.LENGTH
        return None

    def _after_prefill(self, seq: Sequence, work: Work) -> RequestOutput | None:
        t = self.tensors[seq.rid]
        seq.num_computed += work.tokens.numel()
        t.delta = work.delta
        for pos, states in work.snapshots.items():
            self._save_checkpoint(seq, pos, states)
        if seq.num_computed < seq.num_prompt:
            return None
        assert work.hidden is not None
        last_logits = self.model.logits(work.hidden[-1:])
        self._log_logits(seq.rid, last_logits)
        token = sampler.pick(last_logits[0], seq.request.sampling, t.gen)
        t.last_hidden = work.hidden[-1].clone()
        self._register_prompt_blocks(seq)
        self._export_pending(seq)
        seq.token_ids.append(token)
        reason = self._stop_reason(seq, token)
        if seq.prefill_only:
            if reason is None:
                self.handoffs[seq.rid] = self._make_handoff(seq, token, t)
            self._finish(seq)
            return RequestOutput(seq.request.request_id, (token,), True, reason, seq.num_prompt, seq.num_cached)
        seq.status = SeqStatus.DECODE
        if reason is not None:
            self._finish(seq)
        return RequestOutput(
            seq.request.request_id, (token,), reason is not None, reason, seq.num_prompt, seq.num_cached
        )

    def _after_decode(self, seq: Sequence, work: Work, d: list[int], dp: torch.Tensor | None) -> RequestOutput:
        t = self.tensors[seq.rid]
        assert work.hidden is not None
        logits = self.model.logits(work.hidden)
        sp = seq.request.sampling
        emitted = sampler.verify(logits, d, dp, sp, t.gen) if d else [sampler.pick(logits[0], sp, t.gen)]
        if d:
            self.spec.steps += 1
            self.spec.emitted += len(emitted)
            if len(self.spec.recent) < 100_000:
                self.spec.recent.append(len(emitted))
        m = len(emitted) - 1  # drafts accepted; the target computed pending + m drafts
        out: list[int] = []
        reason = None
        for tok in emitted:
            seq.token_ids.append(tok)
            out.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                break
        self._log_logits(seq.rid, logits[: len(out)])
        if reason is not None:
            self._finish(seq)
        else:
            t.delta = work.token_states[m]
            t.last_hidden = work.hidden[m].clone()
            seq.num_computed += m + 1
        return RequestOutput(
            seq.request.request_id, tuple(out), reason is not None, reason, seq.num_prompt, seq.num_cached
        )

    def _log_logits(self, rid: str, rows: torch.Tensor) -> None:
        if self.logit_log is not None:
            self.logit_log.setdefault(rid, []).extend(r.clone() for r in rows)

    # -- caching and exports -------------------------------------------------------
    def _register_prompt_blocks(self, seq: Sequence) -> None:
        if not self.cfg.enable_prefix_caching:
            return
        for i in range(seq.num_prompt // self.unit):
            self.kv_pool.cache(seq.block_ids[i], seq.block_hashes[i])

    def _save_checkpoint(self, seq: Sequence, pos: int, states: list[DeltaState]) -> None:
        """Keep state@pos in a slot keyed by the chain hash of ``[0, pos)``.

        NOTE: vLLM writes this state into slot column ceil(N/B) - 2, whose
        natural key is state@(col+1)*B; when that is not ``pos`` the slot must
        be re-keyed, or a restore would return state@pos as another boundary.
        Our slots are keyed explicitly by the hash at ``pos``.
        """
        key = seq.block_hashes[pos // self.unit - 1]
        b = self.cfg.mamba_block_size
        if needs_rekey(pos, seq.num_prompt, b):
            col = checkpoint_slot_column(seq.num_prompt, b)
            logger.debug(
                "%s: slot column %d re-keyed from state@%d to state@%d", seq.rid, col, natural_position(col, b), pos
            )
        if self.state_pool.lookup(key) is None:
            slot = self.state_pool.allocate(1)
            if slot is not None:
                for i, st in enumerate(states):
                    self.slot_conv[slot[0], i] = st.conv
                    self.slot_ssm[slot[0], i] = st.ssm
                self.state_pool.cache(slot[0], key)
                self.state_pool.free(slot)
        if self.export_checkpoints:
            # KV is exported when the prompt completes (_export_pending): the
            # store needs every full prompt block, including the replay block
            # after ``pos`` that an EAGLE hit drops.
            self.pending_exports[seq.rid] = exports.export_state(self.model_id, states, pos, key)

    def _export_pending(self, seq: Sequence) -> None:
        state = self.pending_exports.pop(seq.rid, None)
        if state is None:
            return
        full = seq.num_prompt // self.unit * self.unit
        kv = exports.export_kv(
            self.model_id, self.kv_caches, seq.block_ids, full, seq.block_hashes[: full // self.unit]
        )
        self.exports.append((kv, state))

    def pop_exports(self) -> list[tuple[KVExport, StateCheckpoint]]:
        out, self.exports = self.exports, []
        return out

    def _make_handoff(self, seq: Sequence, token: int, t: _SeqTensors) -> Handoff:
        assert t.last_hidden is not None
        n = seq.num_prompt
        return Handoff(
            request=seq.request,
            first_token_id=token,
            num_cached_tokens=seq.num_cached,
            kv=exports.export_kv(self.model_id, self.kv_caches, seq.block_ids, n),
            state=exports.export_state(self.model_id, t.delta, n, None),
            draft=exports.export_draft(self.model_id, t.last_hidden, n),
        )

    def _expected_shapes(self, n: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        m = self.mcfg
        kv: list[tuple[int, ...]] = [(n, m.num_kv_heads, m.head_dim)] * (2 * len(self.model.attn_layers))
        st: list[tuple[int, ...]] = []
        for _ in self.model.delta_layers:
            st += [(m.conv_kernel - 1, m.conv_dim), (m.delta_heads, m.delta_key_dim, m.delta_value_dim)]
        return kv, st

    def add_handoff(self, handoff: Handoff) -> None:
        """Continue a request prefilled elsewhere (decode side of P/D)."""
        req = handoff.request
        self._validate(req)
        n = len(req.prompt_token_ids)
        kv_shapes, st_shapes = self._expected_shapes(n)
        exports.check_meta(handoff.kv.meta, self.model_id, "kv", kv_shapes)
        exports.check_meta(handoff.state.meta, self.model_id, "state", st_shapes)
        exports.check_meta(handoff.draft.meta, self.model_id, "draft", [(self.mcfg.hidden_size,)])
        seq = Sequence(req, [*req.prompt_token_ids, handoff.first_token_id], n, [])
        blocks = self.kv_pool.allocate(self.scheduler.blocks_needed(seq))
        if blocks is None:
            raise OverloadedError("no KV blocks free for handoff %s" % req.request_id)
        seq.block_ids = blocks
        exports.import_kv(handoff.kv, self.kv_caches, blocks)
        seq.num_computed = n
        seq.num_cached = handoff.num_cached_tokens
        seq.status = SeqStatus.DECODE
        t = self._start(seq)
        t.delta = exports.import_state(handoff.state, self.device)
        t.last_hidden = handoff.draft.buffers[0].to(self.device).clone()
        self.seqs[seq.rid] = seq
        self.scheduler.running.append(seq)

    def import_checkpoint(
        self, kv: KVExport, state: StateCheckpoint, token_ids: list[int], cache_salt: str | None = None
    ) -> bool:
        """Enter a checkpoint loaded from the store into the local caches.

        Verifies that it belongs to ``token_ids`` (chain hash at its
        position). Returns True if the KV blocks and the state are now cached
        (a later admission then hits them); False if the pools are full.
        """
        pos, kv_pos = state.meta.position, kv.meta.position
        kv_shapes, _ = self._expected_shapes(kv_pos)
        _, st_shapes = self._expected_shapes(pos)
        exports.check_meta(kv.meta, self.model_id, "kv", kv_shapes)
        exports.check_meta(state.meta, self.model_id, "state", st_shapes)
        if pos % self.unit or kv_pos % self.unit or not 0 < pos <= kv_pos <= len(token_ids):
            raise IntegrityError("checkpoint at %d / KV to %d do not fit unit %d" % (pos, kv_pos, self.unit))
        hashes = self.hasher.chain(token_ids[:kv_pos], cache_salt=cache_salt)
        key = hashes[pos // self.unit - 1]
        if state.key != key:
            raise IntegrityError("checkpoint key does not match the prompt's chain hash at %d" % pos)
        for i, h in enumerate(hashes):
            if self.kv_pool.lookup(h) is not None:
                continue
            got = self.kv_pool.allocate(1)
            if got is None:
                return False
            table = [got[0]] * (i + 1)  # only entry i is used by the write below
            for li, (k_cache, v_cache) in enumerate(self.kv_caches):
                rows = slice(i * self.unit, (i + 1) * self.unit)
                AttentionLayer.write(k_cache, table, i * self.unit, kv.buffers[2 * li][rows])
                AttentionLayer.write(v_cache, table, i * self.unit, kv.buffers[2 * li + 1][rows])
            self.kv_pool.cache(got[0], h)
            self.kv_pool.free(got)
        if self.state_pool.lookup(key) is None:
            slot = self.state_pool.allocate(1)
            if slot is None:
                return False
            for i, st in enumerate(exports.import_state(state, self.device)):
                self.slot_conv[slot[0], i] = st.conv
                self.slot_ssm[slot[0], i] = st.ssm
            self.state_pool.cache(slot[0], key)
            self.state_pool.free(slot)
        return True

    # -- introspection -------------------------------------------------------------
    def local_hit(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """The hit an admission of this prompt would get now (no side effects)."""
        probe = Sequence(
            EngineRequest(RequestId("probe"), tuple(token_ids)),
            list(token_ids),
            len(token_ids),
            self.hasher.chain(token_ids, cache_salt=cache_salt),
        )
        return self.scheduler.hit_length(probe)

    def cached_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> tuple[list, list]:
        """(KV block hashes, state hashes) of this prompt's chain held locally now."""
        chain = self.hasher.chain(token_ids, cache_salt=cache_salt)
        kv = [h for h in chain if self.kv_pool.lookup(h) is not None]
        st = [h for h in chain if self.state_pool.lookup(h) is not None]
        return kv, st

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of waiting requests not computed yet (load for routing)."""
        return sum(s.num_prompt - s.num_computed for s in self.scheduler.waiting)

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.kv_pool.num_slots,
            num_free_blocks=self.kv_pool.num_free,
            num_cached_blocks=self.kv_pool.num_cached,
            num_state_slots=self.state_pool.num_slots,
            num_free_state_slots=self.state_pool.num_free,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
        )

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[int]]:
        """Run ``requests`` to completion; returns the generated ids per request."""
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_work():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return out
