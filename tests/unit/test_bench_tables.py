"""bench/README.md's generated blocks equal what bench/tables.py renders from the
committed JSON, byte for byte; a dirty or unknown result is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import provenance_text, tables


def test_readme_blocks_regenerate_exactly() -> None:
    text = tables.README.read_text()
    names = tables._BLOCK.findall(text)
    assert {m[1] for m in names} == set(tables.BLOCKS), "every block is in the README once, and only known ones"
    assert len(names) == len(tables.BLOCKS)
    assert tables.render(text) == text, "bench/README.md differs from its JSON: run `python -m bench.tables`"


def _prov(dirty: bool, started: float = 1.0e9) -> dict:
    return {
        "commit": "a" * 40,
        "dirty": dirty,
        "started": started,
        "started_utc": "2001-09-09 01:46:40 UTC",
        "ended": started + 5,
        "ended_utc": "2001-09-09 01:46:45 UTC",
        "load_average_before": [0.5, 0.4, 0.3],
        "load_average_after": [0.7, 0.5, 0.3],
        "versions": {"python": "3.11.7", "torch": "2.13.0"},
        "machine": {"cpu": "Test CPU", "cpus": 2},
    }


def _soak(prov: dict) -> dict:
    return {
        "config": {"streams": 2, "minutes": 0.5},
        "requests_ok": 10,
        "requests_failed": 0,
        "distinct_prompts": 4,
        "inconsistent_outputs": 0,
        "reference": "ref",
        "reference_mismatches": 0,
        "reference_sampled": 4,
        "reference_row_invariant": True,
        "pools_back_to_baseline": True,
        "requests_per_s": 1.0,
        "tokens_per_s": 100.0,
        "cached_token_fraction": 0.5,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 20.0,
        "rss_growth_mb_after_warmup": {"router": 1.0},
        "checks": {"ok": True, "equal_to_no_cache_reference": False},
        "provenance": prov,
    }


def test_a_dirty_result_is_refused_and_a_clean_one_rendered(tmp_path: Path) -> None:
    (tmp_path / "soak.json").write_text(json.dumps(_soak(_prov(dirty=True))))
    with pytest.raises(provenance_text.DirtyResultError, match="dirty"):
        tables.render_block("soak", tmp_path)
    (tmp_path / "soak.json").write_text(json.dumps(_soak(_prov(dirty=False))))
    text = tables.render_block("soak", tmp_path)
    assert "commit aaaaaaa" in text and "load average (1 min) 0.5-0.7" in text and "python 3.11.7" in text
    assert "| requests | 10 ok, 0 failed |" in text
    assert "`ok` holds" in text and "`equal_to_no_cache_reference` **MISSED**" in text


def test_missing_file_and_unknown_block(tmp_path: Path) -> None:
    assert "No results file" in tables.render_block("soak", tmp_path)
    with pytest.raises(KeyError):
        tables.render_block("no-such-block", tmp_path)


def test_check_mode_reports_a_difference(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- generated: soak -->\nstale\n<!-- /generated: soak -->\n")
    assert tables.main(["--check", "--readme", str(readme)]) == 1
    assert tables.main(["--readme", str(readme)]) == 0
    assert tables.main(["--check", "--readme", str(readme)]) == 0


def test_the_promise_run_renders_its_totals_with_provenance(tmp_path: Path) -> None:
    out = {"requests": 201, "over_promises": 0, "under_promises": 63, "metric_kept": 97856.0, "rows": []}
    out["provenance"] = _prov(False)
    (tmp_path / "vllm_index_promises.json").write_text(json.dumps(out))
    text = tables.render_block("vllm-index-promises", tmp_path)
    assert "commit aaaaaaa" in text and "| requests | over_promises | under_promises | metric_kept |" in text
    assert "| 201 | 0 | 63 | 97,856 |" in text and "rows" not in text
    (tmp_path / "vllm_index_promises.json").write_text(json.dumps({**out, "provenance": _prov(True)}))
    with pytest.raises(provenance_text.DirtyResultError):
        tables.render_block("vllm-index-promises", tmp_path)
