"""Chat templates: the Jinja2 template a GGUF stores in `tokenizer.chat_template`, rendered as HF
`transformers` renders it (sandboxed, trim_blocks and lstrip_blocks, the same helper functions),
so that a prompt reads exactly as the model was trained to see it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import ModelFormatError

# what a template's own code can raise besides jinja2's errors, e.g. `'a' + none` or `messages[5]`
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError)


class ChatTemplate:
    """A compiled chat template; compile once, render per request."""

    def __init__(self, template: str):
        try:
            self._template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as error:
            raise ModelFormatError(f"the chat template does not parse: line {error.lineno}: {error.message}") from error

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
        """The prompt text. `extra` reaches the template as further variables (e.g. `tools`)."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=bos_token, eos_token=eos_token, **extra,
            )
        except _RENDER_ERRORS as error:
            raise ModelFormatError(f"the chat template failed on these messages: {error}") from error


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """Render `messages` (dicts with at least `role` and `content`) through a chat template."""
    return ChatTemplate(template).render(
        messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token, **extra
    )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks; for
    rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # unlike Jinja2's own tojson, no HTML escaping: the output is a prompt, not a web page
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)
