"""Shared pytest setup: markers by folder, GPU tests skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIER_BY_DIR = {"unit": "unit", "integration": "integration", "e2e": "e2e", "gpu": "gpu", "vllm": "vllm"}


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: no GPU tier
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = None
    for item in items:
        tier = _TIER_BY_DIR.get(Path(str(item.fspath)).parent.name)
        if tier and tier not in item.keywords:
            item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("gpu") is not None:  # a marker, not any keyword (a param id may say "gpu")
            if has_cuda is None:
                has_cuda = _cuda_available()
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def fp32_row_exact() -> None:
    """The property the native engine's bit-exact tests rest on (see
    ``hybridpd.engine.native.ops``): fp32 ``rows_mm`` is row-invariant on this
    machine. Measured true on Intel Xeon (Sapphire Rapids: AVX-512, AMX-BF16,
    AVX512-BF16) with torch 2.13 / MKL 2024.2; checked here, not assumed."""
    import torch

    from hybridpd.engine.native.ops import row_invariance_problem

    problem = row_invariance_problem(torch.float32)
    if problem is not None:
        pytest.skip(
            "fp32 matmul rows are not batch-invariant on this CPU (%s; flags: %s): the native engine's "
            "bit-exact guarantee does not hold here" % (problem, _cpu_flags())
        )


def _cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in wanted if f in flags.split()) or "none of " + "/".join(wanted)
