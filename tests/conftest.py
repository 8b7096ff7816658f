"""Shared pytest setup: markers by folder, GPU tests skipped without CUDA, and
the exactness suite (every test that uses ``fp32_row_exact``): run where fp32
matmul rows are batch-invariant, skipped with the reason where not, and
counted at the end (``exactness: N tests ran, M skipped ...``; written to the
file ``$HYBRIDPD_EXACTNESS_REPORT`` names, which ``.ci/run`` reads)."""

from __future__ import annotations

import functools
import os
from collections import Counter
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


#: a reason here makes the exactness suite skip on any machine (to try CI's rule that such a skip fails)
FORCE_SKIP_ENV = "HYBRIDPD_EXACTNESS_FORCE_SKIP"
#: the file the exactness report is written to at the end of the session (``.ci/run`` sets it)
REPORT_ENV = "HYBRIDPD_EXACTNESS_REPORT"
EXACTNESS_FIXTURE = "fp32_row_exact"


@functools.cache
def row_invariance_problem() -> str | None:
    """``None`` where fp32 ``rows_mm`` is row-invariant on this machine, else what
    differed (``hybridpd.engine.native.ops.row_invariance_problem``; probed once
    per session)."""
    import torch

    from hybridpd.engine.native.ops import row_invariance_problem as probe

    return probe(torch.float32)


@pytest.fixture(scope="session")
def fp32_row_exact() -> None:
    """The property the native engine's exactness tests rest on (see
    ``hybridpd.engine.native.ops``): fp32 ``rows_mm`` is row-invariant on this
    machine. Measured true on Intel Xeon (Sapphire Rapids: AVX-512, AMX-BF16,
    AVX512-BF16) with torch 2.13 / MKL 2024.2; checked here, not assumed."""
    forced = os.environ.get(FORCE_SKIP_ENV)
    if forced:
        pytest.skip("forced by %s (%s)" % (FORCE_SKIP_ENV, forced))
    problem = row_invariance_problem()
    if problem is not None:
        pytest.skip(
            "fp32 matmul rows are not batch-invariant on this CPU (%s; flags: %s): the native engine's "
            "path equality does not hold here" % (problem, _cpu_flags())
        )


class _ExactnessTally:
    """Which tests of the exactness suite ran (reached their call) and which skipped, and why."""

    def __init__(self) -> None:
        self.ran: set[str] = set()
        self.skipped: dict[str, str] = {}

    def record(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped[report.nodeid] = " ".join(reason.removeprefix("Skipped: ").split())
        elif report.when == "call":
            self.ran.add(report.nodeid)

    def fields(self) -> dict[str, str]:
        """The report: counts, the skip reasons, and whether the probe says fp32 row
        invariance holds here ("not probed" when no test of the suite was selected)."""
        ran, skipped = len(self.ran - set(self.skipped)), len(self.skipped)
        reasons = "; ".join("%d: %s" % (n, r) for r, n in Counter(self.skipped.values()).most_common())
        if ran or skipped:
            invariance = "holds" if row_invariance_problem() is None else "fails"  # cached: the fixture probed
        else:
            invariance = "not probed"
        summary = "exactness: %d tests ran, %d skipped%s; fp32 row invariance %s%s" % (
            ran,
            skipped,
            " (%s)" % reasons if reasons else "",
            invariance,
            " on this CPU" if invariance != "not probed" else "",
        )
        return {"ran": str(ran), "skipped": str(skipped), "invariance": invariance, "summary": summary}


_EXACTNESS = _ExactnessTally()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if EXACTNESS_FIXTURE in getattr(item, "fixturenames", ()):
        _EXACTNESS.record(report)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line on the exactness suite (none when no test of it was selected), and
    the report file for ``.ci/run`` (``key=value`` lines; written whenever
    ``$HYBRIDPD_EXACTNESS_REPORT`` is set)."""
    fields = _EXACTNESS.fields()
    if fields["invariance"] != "not probed":
        terminalreporter.write_line(fields["summary"])
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text("".join("%s=%s\n" % kv for kv in fields.items()))


def _cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in wanted if f in flags.split()) or "none of " + "/".join(wanted)
