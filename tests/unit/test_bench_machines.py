"""bench/results/ names its machines: every committed results file's provenance
records carry the CPU flags that decide which kernels run (#52)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import machines

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
MACHINE = {"cpu": "Xeon", "cpu_flags": ["avx2", "avx512f"], "machine_id": "m-1", "cpus": 2}


def _record(machine: dict | None) -> dict:
    rec = {"commit": "c" * 40, "dirty": False, "started": 0.0, "ended": 1.0, "load_average_before": [0.1]}
    return rec if machine is None else {**rec, "machine": machine}


#: every results file, the A/B runs' folders too; not ``*_runs/`` (vLLM's client's raw
#: outputs, which git ignores: their summary file keeps every repeat with its provenance)
FILES = sorted(p for p in RESULTS.rglob("*.json") if not any(d.endswith("_runs") for d in p.parent.parts))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_results_file_names_its_machines_cpu_features(path: Path) -> None:
    assert machines.unnamed(path) is None, "%s: rerun it on this machine (bench/README.md)" % path.name


def test_a_file_without_flags_or_provenance_is_caught(tmp_path: Path) -> None:
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"variants": {"a": {"provenance": [_record(MACHINE)]}}}))
    flagless = tmp_path / "flagless.json"
    flagless.write_text(json.dumps({"provenance": _record({"cpu": "AMD EPYC"})}))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"machine": {"date": "then"}}))
    assert machines.unnamed(named) is None
    assert machines.unnamed(flagless) == "a record names no CPU flags"
    assert machines.unnamed(bare) == "no provenance"
    table = machines.markdown(tmp_path)
    assert "| `named.json` | Xeon (avx2 avx512f) | ccccccc | 1970-01-01 |" in table
    assert "| `flagless.json` | **a record names no CPU flags** | | |" in table
