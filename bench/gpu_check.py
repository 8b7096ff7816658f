"""GPU check: the tiny hybrid on CUDA with prefix caching and EAGLE.

    python -m bench.gpu_check [--device cuda] [--json PATH]

Run by ``scripts/gpu_check.sh`` on a lent GPU machine (it also works with
``--device cpu`` so it is tested in CI). In one run, on one device:

* ``reference``: every prompt one at a time, prefix caching off, EAGLE off;
* ``served``: prefix caching on, EAGLE on, chunked prefill, batched - a cold
  round of S streams, then a warm round where every stream grew by D tokens.

It prints and writes the measured hit tokens per warm request (against the
checkpoint the rule places in the cold prompt), the mean EAGLE acceptance length, TTFT cold
vs warm, decode tokens/s, and whether the served greedy tokens equal the
reference token for token. Exit status 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hybridpd.checkpoints import checkpoint_position
from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.profile import profile_of
from hybridpd.models.bundled import resolve_model_dir


def _engine(device: str, dtype: str, **kw: Any) -> NativeEngine:
    base: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "num_kv_blocks": 4096,
        "max_num_batched_tokens": 1024,
        "max_num_seqs": 64,
    }
    base.update(kw)
    cfg = load_config(env={}, overrides=base)
    return NativeEngine(cfg, resolve_model_dir(cfg.model))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _round(engine: NativeEngine, device: str, reqs: list[EngineRequest]) -> dict[str, Any]:
    """Run ``reqs`` together; per request: tokens, cached tokens, TTFT (s)."""
    for r in reqs:
        engine.add_request(r)
    t0 = time.perf_counter()
    out: dict[str, dict[str, Any]] = {r.request_id: {"tokens": [], "cached": 0, "ttft_s": None} for r in reqs}
    while engine.has_work():
        outputs = engine.step()
        _sync(device)
        now = time.perf_counter() - t0
        for o in outputs:
            rec = out[o.request_id]
            if o.new_token_ids and rec["ttft_s"] is None:
                rec["ttft_s"] = now
            rec["tokens"].extend(o.new_token_ids)
            rec["cached"] = max(rec["cached"], o.num_cached_tokens)
    out["_wall_s"] = {"tokens": [], "cached": 0, "ttft_s": time.perf_counter() - t0}
    return out


def _requests(prompts: dict[str, tuple[int, ...]], max_tokens: int) -> list[EngineRequest]:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [EngineRequest(RequestId(rid), toks, sp) for rid, toks in prompts.items()]


def run(device: str, dtype: str, streams: int, start: int, grow: int, gen: int) -> dict[str, Any]:
    """Measure; see the module docstring. Returns the JSON-ready result."""
    rng = random.Random(7)
    cold = {"s%d" % i: tuple(rng.randrange(5, 2048) for _ in range(start)) for i in range(streams)}
    warm = {rid + "w": toks + tuple(rng.randrange(5, 2048) for _ in range(grow)) for rid, toks in cold.items()}

    ref_engine = _engine(device, dtype, enable_prefix_caching=False)
    reference: dict[str, list[int]] = {}
    for rid, toks in {**cold, **warm}.items():
        reference[rid] = _round(ref_engine, device, _requests({rid: toks}, gen))[rid]["tokens"]

    served = _engine(device, dtype, eagle=True, num_speculative_tokens=3)
    _round(served, device, _requests({"warmup": cold["s0"][:64]}, 2))  # kernels, allocator
    cold_out = _round(served, device, _requests(cold, gen))
    warm_out = _round(served, device, _requests(warm, gen))
    cfg = served.cfg
    # the best any cache can do: the checkpoint the rule places in the cold prompt
    ideal = checkpoint_position(start, cfg.prefix_match_unit, profile_of(cfg).eagle_drop("local"))
    mismatched = [rid for rid in reference if {**cold_out, **warm_out}[rid]["tokens"] != reference[rid]]
    warm_cached = [warm_out[rid]["cached"] for rid in warm]
    result = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "dtype": dtype,
        "workload": {"streams": streams, "start_tokens": start, "grow_tokens": grow, "generated_tokens": gen},
        "hit_tokens_per_warm_request": statistics.mean(warm_cached),
        "hit_tokens_ideal": ideal,
        "hit_tokens_min": min(warm_cached),
        "eagle_mean_acceptance_length": served.spec.mean_acceptance_length,
        "ttft_cold_p50_ms": 1000 * statistics.median(cold_out[r]["ttft_s"] for r in cold),
        "ttft_warm_p50_ms": 1000 * statistics.median(warm_out[r]["ttft_s"] for r in warm),
        "decode_tokens_per_s_warm_round": streams * gen / warm_out["_wall_s"]["ttft_s"],
        "greedy_equal_to_reference": not mismatched,
        "mismatched_requests": mismatched,
        "pools_free_after": served.stats().num_free_blocks == served.stats().num_blocks,
    }
    return result


def cuda_problem(device: str) -> str | None:
    """Why ``device`` (``cuda`` or ``cuda:N``) cannot run here, or None."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return "torch sees %d CUDA device(s), no index %d" % (torch.cuda.device_count(), index)
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--start", type=int, default=4000)
    ap.add_argument("--grow", type=int, default=400)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    problem = cuda_problem(args.device)
    if problem:
        raise SystemExit("--device %s: %s" % (args.device, problem))
    from bench import provenance

    with provenance.record() as prov:
        result = run(args.device, args.dtype, args.streams, args.start, args.grow, args.gen)
    result["provenance"] = prov.to_dict()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    if not result["greedy_equal_to_reference"]:
        raise SystemExit("served greedy tokens differ from the reference for %s" % result["mismatched_requests"])


if __name__ == "__main__":
    main()
