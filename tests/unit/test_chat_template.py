"""Chat templates render as Hugging Face's ``apply_chat_template`` renders them
(``hybridpd/chat_template.py``): its ``tojson``, block trimming, loop controls,
``{% generation %}``, ``raise_exception``, special tokens and message names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpd.chat_template import compile_template, special_tokens
from hybridpd.errors import InvalidRequestError
from hybridpd.tokenizer import ChatMessage, ChatOptions, TextTokenizer
from tests.unit.fake_actors import TOKENIZER_DIR

pytestmark = pytest.mark.unit


def test_tojson_keeps_key_order_and_does_not_escape_html() -> None:
    tool = {"type": "function", "function": {"name": "a<b>", "description": "x & y"}}
    got = compile_template("{{ t | tojson }}").render(t=tool)
    assert got == json.dumps(tool, ensure_ascii=False)


def test_blocks_trim_and_loops_break_as_in_hugging_face() -> None:
    src = "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n[{{ m }}]\n{% endfor %}"
    assert compile_template(src).render(messages=[1, 2, 3]) == "[1]\n[2]\n"


def test_generation_blocks_render_their_body_and_raise_exception_refuses() -> None:
    assert compile_template("a{% generation %}b{% endgeneration %}c").render() == "abc"
    with pytest.raises(Exception, match="no system"):
        compile_template("{{ raise_exception('no system') }}").render()


def test_special_tokens_and_names_reach_the_template(tmp_path: Path) -> None:
    cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert special_tokens({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m.name or m.role }}:{{ m.content }}{% endfor %}"
    for f in ("tokenizer.json",):
        (tmp_path / f).write_bytes((TOKENIZER_DIR / f).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = TextTokenizer(tmp_path)
    text = tok.chat_prompt([ChatMessage("user", "hi", name="ada"), ChatMessage("user", "yo")], ChatOptions()).text
    assert text == cfg["bos_token"] + "ada:hiuser:yo"
    with pytest.raises(InvalidRequestError, match="messages"):
        tok.chat_prompt([ChatMessage("user", "hi")], ChatOptions(template_kwargs={"messages": 1}))
