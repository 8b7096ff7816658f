"""What the vLLM tier's modules share within one session (each vLLM engine, server
or stack started on a 2-core machine costs tens of seconds):

* the reference engine of the greedy comparisons (``tests/vllm/workers.py``'s
  :class:`Reference`: prefix caching off, one request at a time, so an answer is a
  fresh engine's), started on first use and stopped here at the session's end;
* one ``hybridpd up --engine vllm`` stack (:data:`STACK_ARGS`, ``vllm_stack``), for
  ``test_request_surface.py`` and ``test_serving.py``: their prompts share no 16-token
  block, and neither reads a count another request moves but through ``>=``;
* one plain ``vllm serve`` (the reference of ``test_vllm_pd.py`` and
  ``test_request_surface.py``; ``--logprobs-mode processed_logprobs``, which for
  a greedy request without logits processors or penalties gives the raw
  logprobs), its prefix cache emptied for each module (``vllm_serve``: vLLM's
  ``/reset_prefix_cache``, in its dev mode), so each module's cached-token counts
  are a fresh server's.

The modules that share these run last in the session, one after the other
(:data:`SHARING_MODULES`), so the server and the stack are up only while they run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.vllm_direct import VllmServer
from tests.e2e.conftest import Stack

#: the shared stack's flags: bf16 (vLLM's CPU GDN kernels), every prompt of its modules
#: prefilled in one step (none is longer than 4,096 tokens)
STACK_ARGS = ["--engine", "vllm", "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-batched-tokens", "4096"]
#: the modules that share the plain ``vllm serve`` (``vllm_serve``) or the stack
#: (``vllm_stack``: the last two), in the order they run: last in the session
SHARING_MODULES = ("test_vllm_pd.py", "test_request_surface.py", "test_serving.py")
#: the plain ``vllm serve``'s prefix_match_unit and max_model_len
SERVE_UNIT, SERVE_MAX_MODEL_LEN = 16, 4096


@pytest.fixture(scope="session", autouse=True)
def _references() -> Iterator[None]:
    """Stop the session's reference engines at its end."""
    yield
    from tests.vllm.workers import close_references

    close_references()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The sharing modules last (in :data:`SHARING_MODULES`' order), so that what they
    share is up only while they run; the rest keep their order."""
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        path = Path(str(item.fspath))
        return 1 + SHARING_MODULES.index(path.name) if path.parent == here and path.name in SHARING_MODULES else 0

    items[:] = sorted(items, key=rank)  # stable: each module keeps its own order


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """``hybridpd up`` with :data:`STACK_ARGS` (two prefill instances, one decode),
    started on first use (one start for test_request_surface.py and test_serving.py)."""
    s = Stack(Path(tmp_path_factory.mktemp("vllm-stack")), STACK_ARGS, start_timeout_s=600)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def _plain_vllm_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """``vllm serve`` as ``vllm-direct`` runs it (bench/vllm_direct.py), with processed
    logprobs and vLLM's dev endpoints (``/reset_prefix_cache``)."""
    from tests.vllm.test_vllm_pd import vllm_serve_venv

    venv = vllm_serve_venv()
    tmp = Path(tmp_path_factory.mktemp("vllm-serve"))
    env = {"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "VLLM_SERVER_DEV_MODE": "1"}  # dev: /reset_prefix_cache
    argv = ["--logprobs-mode", "processed_logprobs"]
    with VllmServer(venv, tmp, SERVE_UNIT, SERVE_MAX_MODEL_LEN, extra_argv=argv, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def vllm_serve(_plain_vllm_serve: VllmServer) -> VllmServer:
    """The session's plain ``vllm serve`` (:data:`SERVE_UNIT`, :data:`SERVE_MAX_MODEL_LEN`),
    its prefix cache emptied for this module."""
    resp = httpx.post(_plain_vllm_serve.http + "/reset_prefix_cache", timeout=60)
    assert resp.status_code == 200 and resp.json() == {"success": True}, resp.text  # no block held
    return _plain_vllm_serve
