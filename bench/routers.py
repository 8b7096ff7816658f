"""Several routers on one stack: the first ``hybridpd up`` and ``n - 1`` more
attached to its Redis index, store, Ray cluster and actors
(``StackProcess.attach_args``), as the Helm chart's router replicas share them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from launch.stack_process import StackProcess


@contextmanager
def attached_routers(first: StackProcess, n: int, args: list[str], workdir: Path) -> Iterator[list[str]]:
    """The HTTP URLs of ``first`` and of ``n - 1`` routers started with the same
    ``args`` and attached to it; the attached ones are stopped on exit (``first``
    is the caller's)."""
    if n < 1:
        raise ValueError("n must be >= 1, got %d" % n)
    extra: list[StackProcess] = []
    try:
        for i in range(1, n):
            attached = StackProcess(workdir / ("router-%d" % i), [*args, *first.attach_args()], env=first.attach_env())
            extra.append(attached.start())
        yield [first.http, *(s.http for s in extra)]
    finally:
        for s in reversed(extra):
            s.stop()
