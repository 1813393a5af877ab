"""Seeded request bodies for the API fuzzer: valid bodies of both generation routes, the same
bodies with one value, key or byte changed, and hostile values from the reports of past 500s.

Every body is JSON-serialised here (so surrogates and huge integers travel as a client would send
them), then possibly damaged at the byte level.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}
WORDS = ("the", "river", "ran", "north", "<|im_end|>", "<|im_start|>", "中文", "é", "\n", " ", "42", "🙂")
HOSTILE_KEYS = ("中文", "a\r\nb", "", " ", "\ud800", "x" * 300, "model ", "__proto__", "1" * 5000, "\x00")
HOSTILE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2, 0.5, -0.0, 1e-320, 1e308, -1e308, 2**31, 2**63, 2**64, -(2**64),
    10**400, -(10**400), "", "a", "a\ud800b", "\udfff", "中文", "²", "١", "\r\n", "x" * 2000,
    "<|im_end|>", "1" * 5000, [], [1], [[]], [None], ["a", "b"], [1, -1, 10**30], {}, {"a": 1},
    {"role": "user"}, {"type": "image_url"}, {"type": "text", "text": 5},
    [{"role": "user", "content": "hi"}], {"5": 1, "²": 2}, {"1" * 20: 1},
)
CONTENT_TYPES = (None, "text/plain", "application/json; charset=latin-1", "application/x-www-form-urlencoded",
                 "application/json; charset=utf-8", "APPLICATION/JSON")


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    origin: str  # how the case was made, for a failure's message


class BodyFuzzer:
    def __init__(self, seed: int, model: str, vocab_size: int):
        self.rng = random.Random(seed)
        self.model = model
        self.vocab_size = vocab_size

    def cases(self, num_cases: int) -> list[FuzzCase]:
        makers = [(self._valid, 3), (self._value_mutation, 5), (self._byte_mutation, 2), (self._header_mutation, 1),
                  (self._odd_route, 1)]
        choices = [maker for maker, weight in makers for _ in range(weight)]
        return [self.rng.choice(choices)() for _ in range(num_cases)]

    def valid_body(self, route: str) -> dict[str, Any]:
        rng = self.rng
        body: dict[str, Any] = {"model": self.model}
        if route == CHAT:
            body["messages"] = [{"role": rng.choice(("system", "user", "assistant", "developer", "tool")),
                                 "content": self._text()} for _ in range(rng.randint(1, 3))]
            body["messages"][-1]["role"] = "user"
        else:
            body["prompt"] = self._text() if rng.random() < 0.7 else [rng.randrange(self.vocab_size)
                                                                       for _ in range(rng.randint(1, 12))]
        body[rng.choice(("max_tokens", "max_completion_tokens") if route == CHAT else ("max_tokens",))] = \
            rng.randint(1, 4)
        optional = {
            "temperature": lambda: rng.choice((0, 0.7, 1.0, 2)), "top_p": lambda: rng.choice((0.1, 0.9, 1)),
            "top_k": lambda: rng.randint(0, 50), "seed": lambda: rng.randrange(2**32),
            "stop": lambda: rng.choice(("\n", ["a", "the"])), "stream": lambda: rng.random() < 0.5,
            "stream_options": lambda: {"include_usage": rng.random() < 0.5}, "n": lambda: 1,
            "logit_bias": lambda: {str(rng.randrange(self.vocab_size)): rng.uniform(-100, 100)},
            "user": lambda: "someone", "presence_penalty": lambda: 0.1,
        }
        for name in rng.sample(sorted(optional), rng.randint(0, 5)):
            body[name] = optional[name]()
        return body

    def _text(self) -> str:
        return "".join(self.rng.choice(WORDS) + " " for _ in range(self.rng.randint(1, 8)))

    def _route(self) -> str:
        return self.rng.choice((CHAT, COMPLETIONS))

    def _case(self, route: str, body: Any, origin: str, headers: dict[str, str] | None = None) -> FuzzCase:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        return FuzzCase("POST", route, raw, JSON_HEADERS if headers is None else headers, origin)

    def _valid(self) -> FuzzCase:
        route = self._route()
        return self._case(route, self.valid_body(route), "valid")

    def _value_mutation(self) -> FuzzCase:
        route = self._route()
        body = self.valid_body(route)
        num_changes = self.rng.choice((1, 1, 1, 2, 3))
        for _ in range(num_changes):
            body = self._mutate(body)
        return self._case(route, body, f"{num_changes} value mutation(s)")

    def _mutate(self, body: Any) -> Any:
        """One change at a random place of the tree: a value replaced, a key renamed or removed."""
        rng = self.rng
        parent, key = self._pick_place(body)
        if parent is None:
            return self._hostile_value()
        action = rng.random()
        if isinstance(parent, dict) and action < 0.15:
            del parent[key]
        elif isinstance(parent, dict) and action < 0.3:
            parent[rng.choice(HOSTILE_KEYS)] = parent.pop(key)
        else:
            parent[key] = self._hostile_value()
        return body

    def _hostile_value(self) -> Any:
        return copy.deepcopy(self.rng.choice(HOSTILE_VALUES))  # a later mutation may change it in place

    def _pick_place(self, body: Any) -> tuple[Any, Any]:
        places: list[tuple[Any, Any]] = [(None, None)]
        pending = [body]
        while pending:
            node = pending.pop()
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, child in items:
                places.append((node, key))
                pending.append(child)
        return self.rng.choice(places[1:] or places)

    def _byte_mutation(self) -> FuzzCase:
        route = self._route()
        raw = bytearray(json.dumps(self.valid_body(route), ensure_ascii=self.rng.random() < 0.5).encode("utf-8"))
        for _ in range(self.rng.randint(1, 4)):
            at = self.rng.randrange(len(raw) + 1)
            action = self.rng.random()
            if action < 0.3:
                raw[at:at + 1] = bytes([self.rng.randrange(256)])
            elif action < 0.5:
                del raw[at:at + self.rng.randint(1, 8)]
            elif action < 0.7:
                raw[at:at] = self.rng.choice((b"\\ud800", b"\xff", b"[" * 80, b'"', b"\\", b"1e999", b",", b"\x00"))
            else:
                del raw[at:]
        return self._case(route, bytes(raw), "byte mutation")

    def _header_mutation(self) -> FuzzCase:
        route = self._route()
        content_type = self.rng.choice(CONTENT_TYPES)
        headers = {} if content_type is None else {"content-type": content_type}
        return self._case(route, self.valid_body(route), f"content type {content_type!r}", headers)

    def _odd_route(self) -> FuzzCase:
        method, path = self.rng.choice((("GET", CHAT), ("PUT", COMPLETIONS), ("GET", "/v1/models/中文%ff"),
                                        ("GET", "/v1/models/" + "x" * 500), ("POST", "/v1/embeddings"),
                                        ("DELETE", "/health"), ("POST", "/v1/models")))
        return FuzzCase(method, path, b'{"model": 1}', JSON_HEADERS, "odd route")
