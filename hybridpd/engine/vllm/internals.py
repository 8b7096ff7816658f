"""The vLLM this engine is written against, and the parts of its internals it reads.

The vLLM engine reaches past vLLM's supported extension points into its in-process
``EngineCore`` (the scheduler's hit rules, its KV-cache manager, its config). A
vLLM release may rename any of them; read fail-open, a rename would silently turn
a feature off (staged prefixes, the EAGLE block drop). So the release is checked
first (:data:`SUPPORTED`) and every internal read at start-up goes through
:func:`require`, which names what is missing instead of guessing a default.
"""

from __future__ import annotations

from typing import Any

from hybridpd.errors import StartupError

#: vLLM releases (version prefixes) whose internals this engine was written and tested against
SUPPORTED = ("0.32.",)


def check_version(version: str) -> None:
    """StartupError unless ``version`` (``vllm.__version__``) is a supported release."""
    if not version.startswith(SUPPORTED):
        raise StartupError(
            "vLLM %s is not supported: hybridpd's vLLM engine reads internals of vLLM %s"
            " (engine/vllm/internals.py); install that release in the vLLM environment"
            % (version, " or ".join(v + "x" for v in SUPPORTED))
        )


def require(obj: Any, name: str, where: str) -> Any:
    """``obj.name``; StartupError naming ``where.name`` when vLLM has no such attribute."""
    if obj is None or not hasattr(obj, name):
        raise StartupError(
            "vLLM has no %s.%s, which the vLLM engine reads (engine/vllm/internals.py): a vLLM release"
            " this hybridpd was not written for?" % (where, name)
        )
    return getattr(obj, name)
