"""A drop-in for ``vllm serve`` (issue #49): the requests a vLLM-server user sends,
to plain ``vllm serve`` and to ``hybridpd up --engine vllm`` (P/D over NIXL, the
router, the actors) on the same tiny Qwen3-Next, compared case by case.

Each case is answered alike (the same status; for a 200, the same greedy tokens
per choice under ``tests/greedy.py``'s near-tie rule, the same text for
/tokenize and /detokenize), or refused by us with a 400 naming a field. The
reference ``vllm serve`` runs with ``--logprobs-mode processed_logprobs``, so
the margins the near-tie rule reads are those of the logits its sampler chose
from (after penalties, bias, bad words and the grammar's mask). A shared prefix
is sent twice, so cached prefixes are compared too. At least 0.9 of the cases
must be answered alike; every 200 we give must be. Our stack is the session's
(``vllm_stack``, tests/vllm/conftest.py), which test_serving.py shares."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import httpx

from bench.vllm_direct import VllmServer
from tests.e2e.conftest import Stack
from tests.greedy import BF16_TOL, GreedyReference, assert_greedy_matches

pytestmark = pytest.mark.timeout(1800)

UNIT, MAX_MODEL_LEN, N = 16, 4096, 8
TEXT = "The configuration of the build system is read from"
#: token prompts are real text's tokens (random ids can end inside a character, where vLLM 0.32's
#: detokenizer primed with the prompt returns the prompt's text with the answer's)
IDS = [472, 1736] * 30
LONG = [472, 1736] * 150
CHAT = [
    {"role": "system", "content": "You answer questions about the build system in one short paragraph."},
    {"role": "user", "content": "Which command regenerates the benchmark tables?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]

Case = tuple[str, str, dict[str, Any]]
#: the cases plain vllm serve answers with a 400 (greedy n > 1; tool_choice auto without a parser)
VLLM_REFUSES = {"n-greedy", "chat-tools-auto"}


def _cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": TEXT, "max_tokens": N, "temperature": 0, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "max_tokens": N, "temperature": 0, **kw}


def cases(plain: list[int], word: str) -> list[Case]:
    """Every case, some built from the reference's plain greedy answer (``plain``: its
    ids) and a word of it (``word``)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        ("text", c, _cmpl()),
        ("ids", c, _cmpl(prompt=IDS)),
        ("n", c, _cmpl(n=2, temperature=0.8, top_k=1, seed=3)),
        ("n-greedy", c, _cmpl(n=2)),
        ("batch", c, _cmpl(prompt=[TEXT, "A second prompt about"])),
        ("logprobs", c, _cmpl(logprobs=3)),
        ("echo", c, _cmpl(echo=True)),
        ("presence_penalty", c, _cmpl(presence_penalty=1.5, max_tokens=16)),
        ("frequency_penalty", c, _cmpl(frequency_penalty=1.5, max_tokens=16)),
        ("repetition_penalty", c, _cmpl(repetition_penalty=1.6, max_tokens=16)),
        ("logit_bias", c, _cmpl(logit_bias={str(plain[1]): -100, "700": 4})),
        ("min_tokens", c, _cmpl(stop_token_ids=[plain[1]], min_tokens=4)),
        ("stop_token_ids", c, _cmpl(stop_token_ids=[plain[2]])),
        ("bad_words", c, _cmpl(bad_words=[word])),
        ("allowed_token_ids", c, _cmpl(allowed_token_ids=[plain[0], plain[3], 600, 601])),
        ("seed", c, _cmpl(seed=123)),
        ("stop", c, _cmpl(stop=[word])),
        ("include_stop_str_in_output", c, _cmpl(stop=[word], include_stop_str_in_output=True)),
        ("ignore_eos", c, _cmpl(ignore_eos=True)),
        ("truncate_prompt_tokens", c, _cmpl(prompt=IDS, truncate_prompt_tokens=20)),
        ("regex", c, _cmpl(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})),
        ("choice", c, _cmpl(structured_outputs={"choice": ["alpha", "beta", "gamma"]})),
        ("grammar", c, _cmpl(structured_outputs={"grammar": 'root ::= "yes" | "no"'})),
        ("long", c, _cmpl(prompt=LONG, frequency_penalty=1.0)),
        ("long-cached", c, _cmpl(prompt=LONG + IDS[:20], frequency_penalty=1.0)),
        ("stream", c, _cmpl(stream=True, stream_options={"include_usage": True})),
        ("chat", ch, _chat()),
        ("chat-logprobs", ch, _chat(logprobs=True, top_logprobs=2)),
        ("chat-n", ch, _chat(n=2, temperature=0.8, top_k=1)),
        (
            "chat-parts",
            ch,
            _chat(
                messages=[
                    CHAT[0],
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Which"}, {"type": "text", "text": "command?"}],
                    },
                ]
            ),
        ),
        ("chat-json-object", ch, _chat(response_format={"type": "json_object"}, max_tokens=12)),
        (
            "chat-json-schema",
            ch,
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "a",
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    },
                },
                max_tokens=12,
            ),
        ),
        (
            "chat-continue",
            ch,
            _chat(
                messages=[*CHAT, {"role": "assistant", "content": "The command"}],
                continue_final_message=True,
                add_generation_prompt=False,
            ),
        ),
        ("chat-no-generation-prompt", ch, _chat(add_generation_prompt=False)),
        ("chat-template-kwargs", ch, _chat(chat_template_kwargs={"enable_thinking": False})),
        (
            "chat-echo",
            ch,
            _chat(
                messages=[*CHAT, {"role": "assistant", "content": "The"}],
                echo=True,
                continue_final_message=True,
                add_generation_prompt=False,
            ),
        ),
        ("chat-tools-none", ch, _chat(tools=TOOLS, tool_choice="none")),
        ("chat-max-completion-tokens", ch, _chat(max_completion_tokens=3)),
        ("chat-tools-auto", ch, _chat(tools=TOOLS)),
        ("tokenize", "/tokenize", {"model": "tiny", "prompt": TEXT}),
        ("tokenize-chat", "/tokenize", {"model": "tiny", "messages": CHAT, "add_generation_prompt": True}),
        ("detokenize", "/detokenize", {"model": "tiny", "tokens": IDS[:10]}),
    ]


def _send(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Status and what to compare: per choice its token ids and text; a 400's message."""
    body = {**body, "return_token_ids": True} if path.startswith("/v1/") else body
    if body.get("stream"):
        per: dict[int, dict[str, Any]] = {}
        with httpx.stream("POST", url + path, json=body, timeout=600) as resp:
            if resp.status_code != 200:
                resp.read()
                return {"status": resp.status_code, "error": resp.text}
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:]).get("choices") or ():
                    got = per.setdefault(c["index"], {"ids": [], "text": ""})
                    got["ids"] += c.get("token_ids") or []
                    got["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
        return {"status": 200, "choices": [per[i] for i in sorted(per)]}
    resp = httpx.post(url + path, json=body, timeout=600)
    out: dict[str, Any] = {"status": resp.status_code}
    if resp.status_code != 200:
        out["error"] = resp.text
        return out
    data = resp.json()
    if not path.startswith("/v1/"):
        out["data"] = {k: data[k] for k in ("tokens", "prompt", "count") if k in data}
        return out
    out["choices"] = [
        {"ids": c.get("token_ids") or [], "text": c["text"] if "text" in c else c["message"]["content"]}
        for c in sorted(data["choices"], key=lambda c: c["index"])
    ]
    return out


def _margins(url: str, path: str, body: dict[str, Any]) -> list[list[float]]:
    """Per prompt, the reference's top-2 processed-logprob margin at each position of its
    greedy answer (every choice of a prompt whose sampling keeps only the top token has it)."""
    if not path.startswith("/v1/"):
        return []
    drop = ("stream", "stream_options", "echo", "logprobs", "top_logprobs", "temperature", "top_k", "seed", "n")
    body = {k: v for k, v in body.items() if k not in drop} | {"temperature": 0}
    body |= {"logprobs": True, "top_logprobs": 5} if "messages" in body else {"logprobs": 5}
    resp = httpx.post(url + path, json=body, timeout=600)
    if resp.status_code != 200:
        return []
    out = []
    for c in sorted(resp.json()["choices"], key=lambda c: c["index"]):
        if "messages" in body:
            tops = [sorted((t["logprob"] for t in e["top_logprobs"]), reverse=True) for e in c["logprobs"]["content"]]
        else:
            tops = [sorted(d.values(), reverse=True) for d in c["logprobs"]["top_logprobs"]]
        out.append([t[0] - t[1] if len(t) > 1 else float("inf") for t in tops])
    return out


def _alike(ref: dict[str, Any], got: dict[str, Any], margins: list[list[float]], sampled: bool) -> str | None:
    """None when ``got`` is answered as ``ref`` is; else why not."""
    if ref["status"] != got["status"]:
        return "status %s against %s (%s)" % (got["status"], ref["status"], ref.get("error") or got.get("error"))
    if ref["status"] != 200:
        return None
    if "data" in ref:
        return None if ref["data"] == got["data"] else "data %s against %s" % (got["data"], ref["data"])
    if len(ref["choices"]) != len(got["choices"]):
        return "%d choices against %d" % (len(got["choices"]), len(ref["choices"]))
    for i, (r, g) in enumerate(zip(ref["choices"], got["choices"], strict=True)):
        if r["ids"] == g["ids"]:
            if r["text"] != g["text"]:
                return "choice %d: the same ids, text %r against %r" % (i, g["text"], r["text"])
            continue
        per_prompt = len(ref["choices"]) // max(len(margins), 1)
        m = margins[i // per_prompt] if margins and per_prompt else []
        if sampled or not m:
            return "choice %d: %r (%s) against %r (%s)" % (i, g["text"], g["ids"], r["text"], r["ids"])
        try:
            assert_greedy_matches(g["ids"], GreedyReference(r["ids"], m), BF16_TOL, what="choice %d" % i)
        except AssertionError as exc:
            return "%s: %r (%s) against %r (%s)" % (str(exc).splitlines()[0], g["text"], g["ids"], r["text"], r["ids"])
    return None


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Every case against ``vllm serve`` (the session's, ``vllm_serve``: with the
    margins), then against our stack (the session's, ``vllm_stack``)."""
    d: VllmServer = request.getfixturevalue("vllm_serve")
    assert "processed_logprobs" in d.argv and d.argv[d.argv.index("--max-model-len") + 1] == str(MAX_MODEL_LEN)
    plain = _send(d.http, "/v1/completions", _cmpl())["choices"][0]
    word = next(iter(re.findall(r"[A-Za-z]{3,}", plain["text"])), "the")
    todo = cases(plain["ids"], word)
    ref = {name: _send(d.http, path, body) for name, path, body in todo}
    margins = {name: _margins(d.http, path, body) for name, path, body in todo}
    s: Stack = request.getfixturevalue("vllm_stack")
    assert s.extra_args[s.extra_args.index("--max-model-len") + 1] == str(MAX_MODEL_LEN)  # as vllm serve's
    got = {name: _send(s.http, path, body) for name, path, body in todo}
    yield {"cases": todo, "ref": ref, "got": got, "margins": margins}


def test_answered_as_vllm_serve_answers_or_refused_by_name(runs: dict[str, Any]) -> None:
    alike, refused, wrong = [], [], []
    for name, _, body in runs["cases"]:
        ref, got = runs["ref"][name], runs["got"][name]
        greedy = body.get("temperature") == 0 or body.get("top_k") == 1  # top_k 1 samples the greedy token
        why = _alike(ref, got, runs["margins"][name], sampled=not greedy)
        if why is None:
            alike.append(name)
        elif got["status"] == 400 and any(k in got["error"] for k in body):
            refused.append(name)
        else:
            wrong.append((name, why))
    report = {"alike": alike, "refused": refused, "wrong": wrong}
    print(json.dumps(report, indent=1))
    # every case but those vllm serve refuses itself was served, so each compares an answer
    served = {name for name, _, _ in runs["cases"] if runs["ref"][name]["status"] == 200}
    assert {name for name, _, _ in runs["cases"]} - served == VLLM_REFUSES, served
    assert not wrong, wrong  # nothing silently ignored: every 200 answers as vllm serve does
    assert len(alike) >= 0.9 * len(runs["cases"]), report


def test_structured_outputs_follow_their_grammar(runs: dict[str, Any]) -> None:
    got = runs["got"]
    checks: dict[str, Callable[[str], bool]] = {
        "regex": lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t) is not None,
        "choice": lambda t: t in ("alpha", "beta", "gamma"),
        "grammar": lambda t: t in ("yes", "no"),
        "chat-json-schema": lambda t: t.startswith("{"),
        "chat-json-object": lambda t: t.lstrip().startswith("{"),
    }
    for name, ok in checks.items():
        assert got[name]["status"] == 200, (name, got[name])
        text = got[name]["choices"][0]["text"]
        assert ok(text), (name, text)
