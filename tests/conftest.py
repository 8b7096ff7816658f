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
