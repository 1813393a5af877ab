"""The request bodies of /v1/completions and /v1/chat/completions, checked field by field.

Parameters this server does not implement are ignored, whatever their value, as the OpenAI API
ignores many (``user``, ``presence_penalty``, ``tools`` ...); their names come back in
the ``x-strata-ignored-params`` response header so a client can see what had no effect. Known
parameters are checked strictly: a wrong type or value is a 400 naming the parameter. ``null``
means "not given" for every optional parameter.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal, Mapping

from strata.engine import sampling
from strata.serve.errors import bad_request, invalid_type, short_repr

Kind = Literal["completion", "chat"]

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 65_536
MAX_SEED = 2**64 - 1
MAX_TOKENS = 2**31 - 1  # past any context; a larger count is refused by its value, not quoted whole
# the OpenAI API's limits: chat's top_logprobs (the engine's own), and the legacy completions' logprobs
MAX_TOP_LOGPROBS = {"chat": sampling.MAX_TOP_LOGPROBS, "completion": 5}
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() also takes "²" and "١"
ROLES = ("system", "developer", "user", "assistant", "tool")
_COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "logit_bias", "n")
KNOWN_PARAMS: Mapping[Kind, frozenset[str]] = {
    "completion": frozenset((*_COMMON, "prompt", "logprobs", "echo")),
    "chat": frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs")),
}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    model: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None
    max_tokens: int | None  # None: the route's default, decided once the prompt length is known
    max_tokens_param: str  # the parameter that gave it, for error messages
    sampling: Mapping[str, Any]  # SamplingParams keywords other than max_tokens
    is_stream: bool
    is_echo: bool  # completions: the prompt's text comes back before the completion's
    is_usage_streamed: bool
    ignored_params: tuple[str, ...]


def parse_request(body: Mapping[str, Any], kind: Kind) -> GenerationRequest:
    fields = {k: v for k, v in body.items() if v is not None}
    model = fields.get("model")
    if model is None:
        raise bad_request("'model' is required; GET /v1/models lists the served model", param="model",
                          code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise invalid_type("model", "a non-empty string", model)
    n = _integer(fields, "n", 1, default=1)
    if n != 1:
        raise bad_request(f"'n' must be 1: this server generates one choice per request, got {short_repr(n)}",
                          param="n")
    max_tokens = _integer(fields, "max_tokens", 1, default=None, maximum=MAX_TOKENS)
    max_tokens_param = "max_tokens"
    if kind == "chat" and "max_completion_tokens" in fields:  # the newer name wins
        max_tokens = _integer(fields, "max_completion_tokens", 1, default=None, maximum=MAX_TOKENS)
        max_tokens_param = "max_completion_tokens"
    is_stream = _boolean(fields, "stream", default=False)
    sampling = _sampling(fields)
    num_logprobs = _num_logprobs(fields, kind)
    if num_logprobs is not None:
        sampling["num_logprobs"] = num_logprobs
    is_echo = kind == "completion" and _boolean(fields, "echo", default=False)
    if is_echo and num_logprobs is not None:
        raise bad_request("'echo' with 'logprobs' asks for the prompt's log-probabilities, which this server does "
                          "not compute; send one of the two", param="echo")
    return GenerationRequest(
        kind=kind, model=model,
        prompt=_prompt(fields) if kind == "completion" else None,
        messages=_messages(fields) if kind == "chat" else None,
        max_tokens=max_tokens, max_tokens_param=max_tokens_param, sampling=sampling, is_stream=is_stream,
        is_echo=is_echo,
        is_usage_streamed=is_stream and _include_usage(fields),
        ignored_params=tuple(sorted(k for k in body if k not in KNOWN_PARAMS[kind])),
    )


def _sampling(fields: Mapping[str, Any]) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    if "temperature" in fields:
        sampling["temperature"] = _number(fields, "temperature", 0.0, 2.0)
    if "top_p" in fields:
        sampling["top_p"] = _number(fields, "top_p", 0.0, 1.0, is_low_open=True)
    if "top_k" in fields:
        sampling["top_k"] = _integer(fields, "top_k", 0, default=None)
    if "seed" in fields:
        sampling["seed"] = _integer(fields, "seed", 0, default=None, maximum=MAX_SEED)
    if "stop" in fields:
        sampling["stop"] = _stop(fields["stop"])
    if "logit_bias" in fields:
        sampling["logit_bias"] = _logit_bias(fields["logit_bias"])
    return sampling


def _num_logprobs(fields: Mapping[str, Any], kind: Kind) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no log-probabilities. Chat asks
    with ``logprobs: true`` and ``top_logprobs``, completions with the legacy ``logprobs: N``."""
    limit = MAX_TOP_LOGPROBS[kind]
    if kind == "completion":
        return _integer(fields, "logprobs", 0, default=None, maximum=limit)
    is_asked = _boolean(fields, "logprobs", default=False)
    num_top = _integer(fields, "top_logprobs", 0, default=None, maximum=limit)
    if num_top is not None and not is_asked:
        raise bad_request("'top_logprobs' needs 'logprobs': true; set it, or leave out top_logprobs",
                          param="top_logprobs")
    return (num_top or 0) if is_asked else None


def _prompt(fields: Mapping[str, Any]) -> str | tuple[int, ...]:
    if "prompt" not in fields:
        raise bad_request("'prompt' is required: a string or an array of token ids", param="prompt",
                          code="missing_required_parameter")
    prompt = fields["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the batch form with a single prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"'prompt' holds {len(prompt)} prompts; this server takes one per request",
                          param="prompt")
    raise invalid_type("prompt", "a string or an array of token ids", prompt)


def _messages(fields: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    if "messages" not in fields:
        raise bad_request("'messages' is required: an array of {role, content} objects", param="messages",
                          code="missing_required_parameter")
    messages = fields["messages"]
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array of {role, content} objects", messages)
    if not messages:
        raise bad_request("'messages' is empty; send at least one message", param="messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid_type(where, "an object with 'role' and 'content'", message)
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}, got {short_repr(role)}",
                          param=f"{where}.role")
    content = _content(message.get("content"), role, f"{where}.content")
    result = {"role": "system" if role == "developer" else role, "content": content}
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid_type(f"{where}.name", "a string", name)
    if name is not None:
        result["name"] = name
    return result


def _content(content: Any, role: str, where: str) -> str:
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for i, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{i}]' must be {{\"type\": \"text\", \"text\": string}}: this server "
                                  "reads text only", param=f"{where}[{i}]")
        return "".join(part["text"] for part in content)
    raise invalid_type(where, "a string or an array of text parts", content)


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_type("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request(f"'stop' takes 1 to {MAX_STOP_STRINGS} non-empty strings, got {len(stops)}: "
                          f"{short_repr(stops)}", param="stop")
    return tuple(stops)


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise invalid_type("logit_bias", "an object mapping token ids to numbers", bias)
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' has {len(bias):,} entries; at most {MAX_LOGIT_BIAS_ENTRIES:,} are accepted",
                          param="logit_bias")
    checked = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(f"'logit_bias' keys must be token ids (1 to 10 ASCII digits), got {short_repr(key)}",
                              param="logit_bias")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {short_repr(value)} for "
                              f"token {key}", param="logit_bias")
        checked[int(key)] = float(value)
    return checked


def _include_usage(fields: Mapping[str, Any]) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid_type("stream_options", "an object", options)
    return _boolean(options, "include_usage", default=False, where="stream_options.include_usage")


def _boolean(fields: Mapping[str, Any], name: str, default: bool, where: str | None = None) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_type(where or name, "true or false", value)
    return value


def _integer(fields: Mapping[str, Any], name: str, minimum: int, default: int | None,
             maximum: int | None = None) -> int | None:
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid_type(name, "an integer", value)
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise bad_request(f"'{name}' must be an integer {allowed}, got {short_repr(value)}", param=name)
    return value


def _number(fields: Mapping[str, Any], name: str, low: float, high: float, is_low_open: bool = False) -> float:
    value = fields[name]
    if not _is_number(value):
        raise invalid_type(name, "a number", value)
    if not (low < value if is_low_open else low <= value) or value > high:
        bracket = "(" if is_low_open else "["
        raise bad_request(f"'{name}' must be a number in {bracket}{low:g}, {high:g}], got {short_repr(value)}",
                          param=name)
    return float(value)


def _is_number(value: Any) -> bool:
    """A JSON number that is finite; an integer of any size is (math.isfinite would overflow on it)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
