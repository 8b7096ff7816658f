"""Chat templates rendered as Hugging Face's ``apply_chat_template`` renders them
(vLLM's server renders through it), so a prompt is the same token for token:

* a sandboxed Jinja environment (``ImmutableSandboxedEnvironment``: a template is
  code shipped with the model) with ``trim_blocks``, ``lstrip_blocks`` and the
  ``loopcontrols`` extension, lenient undefined variables;
* ``tojson`` as ``json.dumps(ensure_ascii=False, sort_keys=False)`` (Jinja's own
  sorts keys and escapes HTML characters), ``raise_exception`` and
  ``strftime_now`` as globals, ``{% generation %}`` blocks rendered as their body;
* the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.

See ``transformers.utils.chat_template_utils._cached_compile_jinja_template``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: the special-token names Hugging Face passes to a template (``special_tokens_map``)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's assistant-mask tag): its body."""

    tags = {"generation"}  # noqa: RUF012  (Jinja declares it so)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in Hugging Face's chat-template environment (module docstring)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token variables of a ``tokenizer_config.json`` (an entry may be a string
    or an ``AddedToken`` dict with its ``content``)."""

    def text(v: Any) -> Any:
        return v.get("content") if isinstance(v, dict) else v

    out = {name: text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [text(v) for v in extra]
    return out
