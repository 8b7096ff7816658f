"""vLLM's own P/D (the ``vllm-pd`` benchmark baseline, bench/vllm_pd.py): a prefill
and a decode ``vllm serve`` of the tiny Qwen3-Next over vLLM's NixlConnector, and
the proxy, give the same greedy tokens as plain ``vllm serve`` (``vllm-direct``,
bench/vllm_direct.py) for the same requests in the same order, and report the
prefill's prefix-cache hit as ``usage.prompt_tokens_details.cached_tokens``.

Token-id prompts and a chat request, streaming and not; one prompt and the chat
request repeated, so they hit the prefill server's prefix cache. bf16 on CPU,
and P/D computes the last prompt token on decode: outputs are compared with
``tests/greedy.py``'s near-tie rule against the direct run's own top-2
logprobs (equal tokens wherever the reference's margin is clear)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import httpx

from bench.vllm_direct import VllmServer, vllm_venv
from bench.vllm_pd import VllmPd
from bench.vllm_pd_proxy import PREFILL_CACHED_HEADER
from tests.greedy import BF16_TOL, GreedyReference, assert_greedy_matches
from tests.vllm.workers import tokens

#: two vllm serve starts (prefill and decode; the reference is the session's) on a shared 2-core machine
pytestmark = pytest.mark.timeout(1800)

UNIT, MAX_MODEL_LEN, MAX_TOKENS = 16, 4096, 8
CHAT = [
    {"role": "system", "content": "You answer questions about the build system in one short paragraph."},
    {"role": "user", "content": "Which command regenerates the benchmark tables from the committed results?"},
]
LONG = tokens(1400, 3)
#: (name, prompt token ids or None for CHAT, stream), sent in this order to both setups
REQUESTS: list[tuple[str, list[int] | None, bool]] = [
    ("ids-40-stream", tokens(40, 1), True),
    ("ids-700", tokens(700, 2), False),
    ("ids-1400-stream", LONG, True),
    ("ids-1400-again", LONG, False),  # the prefill server's prefix cache: a hit
    ("chat", None, False),
    ("chat-again-stream", None, True),  # a hit too
]


def vllm_serve_venv() -> Path:
    """The vLLM environment with a ``vllm`` executable (this one, else the repo's), or skip."""
    here = Path(sys.prefix)
    if (here / "bin" / "vllm").exists():
        return here
    venv = vllm_venv()
    if venv is None:
        pytest.skip("no vLLM environment with a vllm executable")
    return venv


def _send(url: str, prompt: list[int] | None, stream: bool, logprobs: bool) -> dict[str, Any]:
    """One greedy request; its output token ids, cached tokens, the proxy's
    prefill-hit header, and (``logprobs``: the reference) the top-2 margins."""
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    path = "/v1/completions" if prompt is not None else "/v1/chat/completions"
    if prompt is not None:
        body["prompt"] = prompt
        if logprobs:
            body.update(logprobs=2, return_tokens_as_token_ids=True)
    else:
        body["messages"] = CHAT
        if logprobs:
            body.update(logprobs=True, top_logprobs=2)
    ids: list[int] = []
    margins: list[float] = []
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        usage = None
        with httpx.stream("POST", url + path, json=body, timeout=600) as resp:
            resp.raise_for_status()
            header = resp.headers.get(PREFILL_CACHED_HEADER)
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                for ch in data.get("choices") or ():
                    ids.extend(ch.get("token_ids") or ())
                usage = data.get("usage") or usage
        assert usage is not None
    else:
        resp = httpx.post(url + path, json=body, timeout=600)
        resp.raise_for_status()
        header = resp.headers.get(PREFILL_CACHED_HEADER)
        out = resp.json()
        choice, usage = out["choices"][0], out["usage"]
        ids = list(choice["token_ids"])
        if logprobs and prompt is not None:
            tops = [sorted(d.values(), reverse=True) for d in choice["logprobs"]["top_logprobs"]]
        elif logprobs:
            tops = [
                sorted((t["logprob"] for t in c["top_logprobs"]), reverse=True) for c in choice["logprobs"]["content"]
            ]
        if logprobs:
            margins = [t[0] - t[1] if len(t) > 1 else float("inf") for t in tops]
    assert usage["completion_tokens"] == MAX_TOKENS == len(ids), (usage, ids)
    return {
        "tokens": ids,
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "prompt_tokens": usage["prompt_tokens"],
        "header": None if header is None else int(header),
        "margins": margins,
    }


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, vllm_serve: VllmServer
) -> Iterator[dict[str, dict[str, dict[str, Any]]]]:
    """Every request against plain ``vllm serve`` (the session's, its prefix cache
    empty: ``vllm_serve``, tests/vllm/conftest.py; non-streaming, with logprobs: the
    reference), then against vllm-pd (as REQUESTS says)."""
    venv = vllm_serve_venv()
    tmp = Path(tmp_path_factory.mktemp("vllm-pd"))
    assert vllm_serve.argv[vllm_serve.argv.index("--max-model-len") + 1] == str(MAX_MODEL_LEN)
    ref = {name: _send(vllm_serve.http, p, False, logprobs=True) for name, p, _ in REQUESTS}
    ref_tok = _tokenize(vllm_serve.http)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
        with VllmPd(venv, tmp, UNIT, MAX_MODEL_LEN) as pd:
            got = {name: _send(pd.http, p, stream, logprobs=False) for name, p, stream in REQUESTS}
            models = httpx.get(pd.http + "/v1/models", timeout=30).json()
            tok = _tokenize(pd.http)
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert tok == ref_tok and len(tok) > 0  # /tokenize goes to the prefill server
    yield {"direct": ref, "pd": got}


def _tokenize(url: str) -> list[int]:
    body = {"model": "tiny", "messages": CHAT, "add_generation_prompt": True}
    resp = httpx.post(url + "/tokenize", json=body, timeout=60)
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def test_outputs_equal_plain_vllm_serve(runs: dict[str, dict[str, dict[str, Any]]]) -> None:
    for name, _, _ in REQUESTS:
        ref, got = runs["direct"][name], runs["pd"][name]
        assert got["prompt_tokens"] == ref["prompt_tokens"], name
        assert_greedy_matches(got["tokens"], GreedyReference(ref["tokens"], ref["margins"]), BF16_TOL, what=name)


def test_cached_tokens_are_the_prefill_servers_hit(runs: dict[str, dict[str, dict[str, Any]]]) -> None:
    pd, direct = runs["pd"], runs["direct"]
    for name, _, _ in REQUESTS:
        # what the decode server reports is what the prefill server's own response said
        assert pd[name]["cached"] == pd[name]["header"], (name, pd[name])
        # and the same hit plain vllm serve had for the same request in the same order
        assert pd[name]["cached"] == direct[name]["cached"], (name, pd[name]["cached"], direct[name]["cached"])
    assert pd["ids-1400-stream"]["cached"] == 0
    again = pd["ids-1400-again"]["cached"]
    assert 0 < again < len(LONG) and again % UNIT == 0, again
    assert pd["chat-again-stream"]["cached"] > 0
