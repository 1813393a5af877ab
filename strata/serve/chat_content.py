"""Chat messages rendered so that what a client wrote stays text: a control-token text typed in a
message (``<|im_end|>``) is tokenized as the characters it is, while the control tokens the chat
template writes stay control tokens.

Before rendering, each control-token text in a message's content or name is replaced by a
placeholder: a private-use character found in neither the template nor any message. The rendered
prompt is then cut at the placeholders into segments: the template's text, whose control texts are
parsed, and each placeholder's control text, which is not. A template that transforms content
(trims it, splits it) handles a placeholder like any other character.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from strata.model.chat import ChatTemplate
from strata.serve.errors import bad_request

_PRIVATE_USE = re.compile("[\ue000-\uf8ff\U000f0000-\U000ffffd]")
_PLACEHOLDER_RANGES = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))
_CLIENT_KEYS = ("content", "name")
Segment = tuple[str, bool]  # (text, whether its control-token texts become control tokens)


def render_literal_segments(template: ChatTemplate, template_source: str, messages: Sequence[Mapping[str, Any]],
                            control_texts: Sequence[str], **variables: str) -> list[Segment]:
    """The rendered prompt as segments for ``Tokenizer.encode_segments``; ``control_texts``
    longest first (``Tokenizer.control_texts``)."""
    client_texts = [text for message in messages for key in _CLIENT_KEYS if isinstance(text := message.get(key), str)]
    typed = [control for control in control_texts if any(control in text for text in client_texts)]
    if not typed:
        return [(template.render(messages, add_generation_prompt=True, **variables), True)]
    taken = {c for text in (template_source, *client_texts, *variables.values()) for c in _PRIVATE_USE.findall(text)}
    free = (chr(code) for code in itertools.chain(*_PLACEHOLDER_RANGES) if chr(code) not in taken)
    placeholders = {control: next(free, None) for control in typed}
    if None in placeholders.values():
        raise bad_request("the messages use every private-use character, which this server needs to keep "
                          "control-token texts in them as plain text", param="messages")
    typed_pattern = re.compile("|".join(re.escape(control) for control in typed))

    def with_placeholders(message: Mapping[str, Any]) -> dict[str, Any]:
        return {key: typed_pattern.sub(lambda match: placeholders[match.group()], value)
                if key in _CLIENT_KEYS and isinstance(value, str) else value for key, value in message.items()}

    rendered = template.render([with_placeholders(message) for message in messages], add_generation_prompt=True,
                               **variables)
    control_of = {placeholder: control for control, placeholder in placeholders.items()}
    parts = re.split(f"([{''.join(control_of)}])", rendered)
    return [(control_of[part], False) if part in control_of else (part, True) for part in parts if part]
