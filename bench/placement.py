"""The placement report: checkpoint placement policies replayed on recorded workloads.

``hybridpd bench placement`` replays four token-id workloads through the
router's and the engine's own placement arithmetic (``hybridpd/placement.py``,
``hybridpd/checkpoints.py``), tensor-free, and counts, per policy, the tokens
each request restores and the state checkpoints written (bytes: one state of
the bundled tiny model each):

* ``fanout``: conversations sharing a system prompt (``bench.shared_prefix``);
  counted from the second conversation;
* ``tree``: an agent tree (``bench.shared_prefix``), every request;
* ``twosharer``: RAG pairs (``bench.shared_prefix``), the second of each pair;
* ``growing``: streams whose prompts grow every round (``bench.growing_streams``'
  shape), every request.

The replay assumes every attention block stays cached (an index that knows
every earlier prompt) and no state is evicted: it isolates placement. A
request's hit is the deepest state written by an earlier request at a position
it shares (at most ``(N - 1) // u * u``); its ideal is its longest prefix shared
with an earlier request, rounded down to u. Each request writes its tail
(``checkpoint_position``), the junction the index reports
(``requested_checkpoints``, as the branch-aware router asks), and what the
policy places: ``tail+junction`` (placement off), ``value`` and ``geometric``
(at most ``placement_checkpoints`` each; ``value`` fewer where one would add
less than ``placement_min_gain`` of the prompt's prefill; ``value`` is also
replayed without that threshold, at the cap and at one, as ablations), and ``interval-I`` for a range of I. The
comparison is at equal state bytes: the best fixed interval among those that
wrote no more states than ``value`` (``best_interval``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.shared_prefix import PlannedRequest, Workload, build_plan, lcp
from hybridpd.checkpoints import checkpoint_position, requested_checkpoints
from hybridpd.divergence import DivergenceHistory
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.state_cache import slot_bytes
from hybridpd.placement import PlacementAsk, place

WORKLOADS = ("fanout", "tree", "twosharer", "growing")
#: the fixed intervals the report tries (tokens)
INTERVALS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096)


@dataclass(frozen=True, slots=True)
class Replay:
    unit: int = 16
    mamba_block_size: int = 16
    alignment: int = 16
    placement_checkpoints: int = 2  # the config's defaults
    placement_min_gain: float = 0.05
    streams: int = 4  # growing
    first_tokens: int = 1000
    step_tokens: int = 200
    rounds: int = 6
    seed: int = 0


def workloads(r: Replay) -> dict[str, tuple[list[tuple[int, ...]], list[bool]]]:
    """Per workload: its prompts in order and which ones are counted."""
    plan = [p for p in build_plan(dataclasses.replace(Workload(), seed=r.seed), _no_chat) if not p.chat]
    out: dict[str, tuple[list[tuple[int, ...]], list[bool]]] = {}
    for name in ("fanout", "tree", "twosharer"):
        rs: list[PlannedRequest] = [p for p in plan if p.phase == name + "_ids"]
        counted = [i >= 1 for i in range(len(rs))] if name == "fanout" else [p.counted for p in rs]
        out[name] = ([p.tokens for p in rs], counted)
    rng = random.Random(r.seed)
    longest = r.first_tokens + r.step_tokens * (r.rounds - 1)
    streams = [tuple(rng.randrange(5, 2048) for _ in range(longest + 1)) for _ in range(r.streams)]
    grow = [s[: r.first_tokens + r.step_tokens * k + 1] for k in range(r.rounds) for s in streams]
    out["growing"] = (grow, [True] * len(grow))
    return out


def _no_chat(msgs: Any) -> list[int]:
    return [0] * (4 * sum(len(c) for _, c in msgs) + 1)


def replay(
    prompts: Sequence[tuple[int, ...]], counted: Sequence[bool], policy: str, r: Replay, interval: int = 0
) -> dict[str, Any]:
    """Hits, ideal and states written for ``prompts`` under ``policy``."""
    u, b, a = r.unit, r.mamba_block_size, r.alignment
    written: list[tuple[int, int]] = []  # (prompt index, position)
    history = DivergenceHistory()
    hit_sum = ideal_sum = 0
    for i, toks in enumerate(prompts):
        n = len(toks)
        shared = [lcp(toks, prompts[j]) for j in range(i)]
        cap = (n - 1) // u * u
        hit = max((p for j, p in written if p <= min(shared[j], cap)), default=0)
        ideal = min(max(shared, default=0), n - 1) // u * u
        if counted[i]:
            hit_sum, ideal_sum = hit_sum + hit, ideal_sum + ideal
        known = max(shared, default=0) // u * u
        history.observe(n, known, u)
        junction = requested_checkpoints((known,), hit, n, u, b, a, False) if known > hit else ()
        tail = checkpoint_position(n, u, False)
        mine = {tail, *junction}
        pol = "off" if policy == "tail+junction" else ("interval" if policy.startswith("interval") else policy)
        count, gain = r.placement_checkpoints, r.placement_min_gain
        mine |= set(
            place(
                PlacementAsk(
                    pol, n, hit, tuple(sorted(mine)), count, u, b, a, False, history, interval=interval, min_gain=gain
                )
            )
        )
        for p in sorted(mine):
            if p > hit and not any(j < i and p <= shared[j] and q == p for j, q in written):  # a new state
                written.append((i, p))
    return {"hit_tokens": hit_sum, "ideal_tokens": ideal_sum, "hit_ratio": hit_sum / ideal_sum, "states": len(written)}


def report(r: Replay | None = None) -> dict[str, Any]:
    """The replay's results and checks, for another benchmark's JSON (``bench
    shared-prefix`` embeds it as ``placement``)."""
    r = r or Replay()
    results = _replay_all(r)
    return {
        "replay": asdict(r),
        "state_bytes_each": results.pop("_state_bytes"),
        "workloads": results,
        "checks": checks(results),
    }


def run(json_path: Path, r: Replay | None = None) -> dict[str, Any]:
    """Replay every workload under every policy; write JSON + markdown."""
    from bench.provenance import record
    from bench.report import write_json

    r = r or Replay()
    with record() as prov:
        out = report(r)
    out["provenance"] = prov.to_dict()
    write_json(json_path, out)
    _plot(json_path.with_suffix(".png"), out)
    json_path.with_suffix(".md").write_text(markdown(out))
    return out


def _plot(path: Path, out: dict[str, Any]) -> None:
    from bench.report import plot_grouped

    w = out["workloads"]
    pols = {"tail+junction": "tail+junction", "geometric": "geometric", "value": "value"}
    panels: dict[str, dict[str, dict[str, float]]] = {"hit / ideal": {}, "states written": {}}
    for label, key in (*pols.items(), ("best interval", "best_interval")):
        panels["hit / ideal"][label] = {n: (row[key] or {}).get("hit_ratio", 0.0) for n, row in w.items()}
        panels["states written"][label] = {n: float((row[key] or {}).get("states", 0)) for n, row in w.items()}
    plot_grouped(
        path,
        panels,
        "checkpoint placement replay, at most %d placed per prefill" % out["replay"]["placement_checkpoints"],
    )


def _replay_all(r: Replay) -> dict[str, Any]:
    state_bytes = slot_bytes(3, HybridModelConfig(num_layers=4))  # the bundled tiny model: 3 delta layers
    results: dict[str, Any] = {}
    for name, (prompts, counted) in workloads(r).items():
        print("placement: replaying %s (%d prompts)" % (name, len(prompts)), flush=True)
        row: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": sum(len(p) for p in prompts)}
        for policy in ("tail+junction", "geometric", "value"):
            row[policy] = replay(prompts, counted, policy, r)
        # ablations of the threshold: value always placing the cap, and always one
        row["value_no_min_gain"] = replay(prompts, counted, "value", dataclasses.replace(r, placement_min_gain=0.0))
        one = dataclasses.replace(r, placement_checkpoints=1, placement_min_gain=0.0)
        row["value_one_no_min_gain"] = replay(prompts, counted, "value", one)
        row["intervals"] = {str(i): replay(prompts, counted, "interval-%d" % i, r, i) for i in INTERVALS}
        ablations = (row["value_no_min_gain"], row["value_one_no_min_gain"])
        for x in (row["tail+junction"], row["geometric"], row["value"], *ablations, *row["intervals"].values()):
            x["state_bytes"] = x["states"] * state_bytes
        fits = {i: x for i, x in row["intervals"].items() if x["states"] <= row["value"]["states"]}
        best = max(fits, key=lambda i: (fits[i]["hit_ratio"], -fits[i]["states"]), default=None)
        row["best_interval"] = None if best is None else {"interval": int(best), **fits[best]}
        results[name] = row
    results["_state_bytes"] = state_bytes
    return results


def checks(results: dict[str, Any]) -> dict[str, Any]:
    """#27: ``value`` at least the best fixed interval at no more state bytes on every
    workload, above it on at least two."""
    above: list[str] = []
    below: list[str] = []
    for name, row in results.items():
        best = row["best_interval"]
        ours = row["value"]["hit_ratio"]
        theirs = best["hit_ratio"] if best else 0.0
        if ours > theirs:
            above.append(name)
        elif ours < theirs:
            below.append(name)
    return {
        "value_not_below_best_interval": not below,
        "value_below_best_interval_on": sorted(below),
        "value_above_best_interval_on": sorted(above),
        "value_above_best_interval_on_two": len(above) >= 2,
    }


def markdown(out: dict[str, Any]) -> str:
    rows = [
        "| workload | policy | hit / ideal | states written | state MiB |",
        "|---|---|---|---|---|",
    ]
    for name, row in out["workloads"].items():
        best = row["best_interval"]
        cells = [("tail+junction", row["tail+junction"]), ("geometric", row["geometric"]), ("value", row["value"])]
        cells += [
            ("value, min gain 0", row["value_no_min_gain"]),
            ("value, one, min gain 0", row["value_one_no_min_gain"]),
        ]
        if best:
            cells.append(("highest-hit interval at <= value's states: %d" % best["interval"], best))
        for policy, x in cells:
            rows.append(
                "| %s | %s | %.3f | %d | %.1f |"
                % (name, policy, x["hit_ratio"], x["states"], x.get("state_bytes", 0) / (1 << 20))
            )
    return "\n".join(rows) + "\n"
