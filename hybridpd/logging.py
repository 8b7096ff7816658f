"""Logging setup: one format for every process (router, actors, CLI).

Use lazy ``%s`` formatting in log calls, never f-strings.
"""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once; ``HYBRIDPD_LOG_LEVEL`` overrides."""
    lvl = (level or os.environ.get("HYBRIDPD_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=lvl, format=_FORMAT)
    logging.getLogger().setLevel(lvl)
