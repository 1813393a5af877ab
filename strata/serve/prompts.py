"""From a checked request to what the engine takes: prompt token ids and sampling parameters.

Chat prompts are the GGUF's own chat template rendered with the generation prompt; the template's
control tokens are parsed, the messages' text is plain text (``chat_content``) unless
``serve.parse_special_in_content``. The whole conversation is sent every time; the engine reuses
the KV prefix it already holds, so a follow-up turn only prefills its new tokens.

A text is tokenized only when it can fit the context: no token covers more than the vocabulary's
longest piece, so a text longer than the context times that many bytes is refused uncounted
(tokenizing megabytes takes seconds and hundreds of MB).
"""

from __future__ import annotations

import dataclasses
import re

from strata.engine.sampling import SamplingParams
from strata.errors import ConfigError, ModelFormatError
from strata.model.chat import ChatTemplate
from strata.model.tokenizer import Tokenizer
from strata.serve.chat_content import render_literal_segments
from strata.serve.errors import bad_request, short_repr
from strata.serve.schemas import GenerationRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to the rest of the context
_PARAM_IN_MESSAGE = re.compile(r"sampling parameter (\w+)")


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    tokens: tuple[int, ...]
    params: SamplingParams
    echo_text: str = ""  # a completion's ``echo``: the prompt's text, sent before the completion's


class PromptBuilder:
    """Per engine: the tokenizer, the compiled chat template and the context length."""

    def __init__(self, tokenizer: Tokenizer, context_tokens: int, is_parse_special_in_content: bool = False):
        self._tokenizer = tokenizer
        self._context_tokens = context_tokens
        self._template = ChatTemplate(tokenizer.chat_template) if tokenizer.chat_template else None
        self._is_parse_special_in_content = is_parse_special_in_content

    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        tokens = self._chat_tokens(request) if request.kind == "chat" else self._completion_tokens(request)
        if not tokens:
            raise bad_request("the prompt is empty (0 tokens); send some text", param=_prompt_param(request))
        max_tokens = self._max_tokens(request, len(tokens))
        bias = request.sampling.get("logit_bias", {})
        outside = sorted(t for t in bias if t >= self._tokenizer.vocab_size)
        if outside:
            raise bad_request(f"'logit_bias' names token {outside[0]}, but the vocabulary has "
                              f"{self._tokenizer.vocab_size} tokens (ids 0..{self._tokenizer.vocab_size - 1})",
                              param="logit_bias")
        try:
            params = SamplingParams(max_tokens=max_tokens, **request.sampling)
        except ConfigError as exc:
            match = _PARAM_IN_MESSAGE.search(str(exc))
            raise bad_request(str(exc), param=match.group(1) if match else None) from None
        echo_text = ""
        if request.is_echo:
            echo_text = request.prompt if isinstance(request.prompt, str) else self._tokenizer.decode(tokens)
        return PreparedPrompt(tuple(tokens), params, echo_text)

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one generated token for its log-probability entry: the text its bytes spell, or
        ``bytes:\\xNN...`` where they are part of a UTF-8 sequence (as the OpenAI API names such a token)."""
        piece = self._tokenizer.token_piece(token_id)
        try:
            return piece.decode("utf-8"), piece
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in piece), piece

    def _completion_tokens(self, request: GenerationRequest) -> list[int]:
        if isinstance(request.prompt, str):
            self._check_text_fits(len(request.prompt), request)
            return self._tokenizer.encode(request.prompt)
        tokens = list(request.prompt or ())
        self._check_room(len(tokens), request)
        outside = [t for t in tokens if not 0 <= t < self._tokenizer.vocab_size]
        if outside:
            raise bad_request(f"'prompt' holds token id {short_repr(outside[0])}, outside the vocabulary "
                              f"(ids 0..{self._tokenizer.vocab_size - 1})", param="prompt")
        return tokens

    def _chat_tokens(self, request: GenerationRequest) -> list[int]:
        if self._template is None:
            raise bad_request("the model's GGUF has no chat template (tokenizer.chat_template); "
                              "use /v1/completions with a formatted prompt", code="no_chat_template")
        messages = request.messages or ()
        self._check_text_fits(sum(len(m["content"]) + len(m.get("name", "")) for m in messages), request)
        variables = {"bos_token": self._token_text(self._tokenizer.bos_id),
                     "eos_token": self._token_text(self._tokenizer.eos_id)}
        try:
            if self._is_parse_special_in_content:
                segments = [(self._template.render(messages, add_generation_prompt=True, **variables), True)]
            else:
                segments = render_literal_segments(self._template, self._tokenizer.chat_template, messages,
                                                   self._tokenizer.control_texts, **variables)
        except ModelFormatError as exc:
            raise bad_request(f"the messages do not fit the model's chat template: {exc}", param="messages") from None
        self._check_text_fits(sum(len(text) for text, _ in segments), request)
        return self._tokenizer.encode_segments(segments)

    def _check_text_fits(self, num_chars: int, request: GenerationRequest) -> None:
        """400 for a text that holds more tokens than the context, known from its length alone."""
        min_tokens = -(-num_chars // self._tokenizer.max_token_bytes)  # a character is at least one byte
        if min_tokens >= self._context_tokens:
            raise bad_request(f"the prompt has {num_chars:,} characters, at least {min_tokens:,} tokens (no token "
                              f"of this model covers more than {self._tokenizer.max_token_bytes} bytes), but the "
                              f"context holds {self._context_tokens:,} (runtime.context_tokens); shorten the prompt",
                              param=_prompt_param(request), code="context_length_exceeded")

    def _check_room(self, num_prompt: int, request: GenerationRequest) -> None:
        if num_prompt >= self._context_tokens:
            raise bad_request(f"the prompt has {num_prompt:,} tokens but the context holds {self._context_tokens:,} "
                              f"(runtime.context_tokens), leaving no room to generate; shorten the prompt",
                              param=_prompt_param(request), code="context_length_exceeded")

    def _max_tokens(self, request: GenerationRequest, num_prompt: int) -> int:
        context = self._context_tokens
        self._check_room(num_prompt, request)
        room = context - num_prompt
        if request.max_tokens is None:
            return min(room, DEFAULT_COMPLETION_MAX_TOKENS) if request.kind == "completion" else room
        if request.max_tokens > room:
            param = request.max_tokens_param
            raise bad_request(f"the context holds {context:,} tokens; the prompt has {num_prompt:,} and "
                              f"{param} asks for {request.max_tokens:,} more (at most {room:,} fit)",
                              param=param, code="context_length_exceeded")
        return request.max_tokens

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokenizer.token_piece(token_id).decode("utf-8", errors="replace")


def _prompt_param(request: GenerationRequest) -> str:
    return "messages" if request.kind == "chat" else "prompt"
