"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

The sampled chain follows llama.cpp's default order: logit bias, top-k, top-p (on the
untempered distribution), temperature, then one draw from a seeded generator. Temperature 0 is
greedy. Every function is pure apart from the draw consuming the generator. ``token_logprobs`` is
what a request that asks for log-probabilities gets for each token: the model's distribution at
temperature 1, before the request's logit bias, top-k and top-p.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from strata.errors import ConfigError, NonFiniteLogitsError

_MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (the OpenAI API's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    temperature: >= 0; 0 means greedy. top_k: >= 0; 0 keeps every token. top_p: in (0, 1]; 1
    keeps every token. seed: None draws fresh entropy. max_tokens: >= 1. stop: strings that end
    the generated text (not included in it). logit_bias: token id -> added logit (-inf bans).
    num_logprobs: None, or each token's log-probability with that many most likely alternatives
    (0..MAX_TOP_LOGPROBS): such a request is decoded on the host, where the logits are.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    num_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature", "a finite number >= 0 (0 means greedy)", self.temperature)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= _MAX_SEED),
               "seed", f"null or an integer in [0, {_MAX_SEED}]", self.seed)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(self.num_logprobs is None or (_is_int(self.num_logprobs) and 0 <= self.num_logprobs <= MAX_TOP_LOGPROBS),
               "num_logprobs", f"null or an integer in [0, {MAX_TOP_LOGPROBS}]", self.num_logprobs)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop), "stop", "a list of non-empty strings", self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check(is_ok: bool, name: str, allowed: str, value: object) -> None:
    if not is_ok:
        raise ConfigError(f"sampling parameter {name} must be {allowed}, got {value!r}")


def _checked_bias(bias: Mapping[int, float]) -> dict[int, float]:
    _check(isinstance(bias, Mapping), "logit_bias", "a mapping of token id to number", bias)
    checked = {}
    for token, value in bias.items():
        token_id = int(token) if isinstance(token, str) and token.lstrip("-").isdigit() else token
        _check(_is_int(token_id) and token_id >= 0, "logit_bias", "keyed by token ids >= 0", token)
        _check(_is_number(value) and not math.isnan(value) and value != math.inf,
               "logit_bias", "values that are numbers or -inf (ban)", value)
        checked[int(token_id)] = float(value)
    return checked


def check_finite_logits(logits: np.ndarray, num_prompt_tokens: int, position: int) -> None:
    """A NonFiniteLogitsError unless every logit [V] is finite: a token picked from NaN logits is
    argmax's first id, which ends the request as an empty success. One float64 sum (a NaN or an
    infinity makes it non-finite; finite float32 logits cannot overflow it), no temporary array."""
    if not math.isfinite(float(np.sum(logits, dtype=np.float64))):
        raise NonFiniteLogitsError(
            f"the logits of the token at position {position} (a request of {num_prompt_tokens} prompt tokens) are "
            "NaN or infinite: the model's weights or activations are not finite; check the model file "
            "(strata refuses weights that are not finite at load) or its numeric range")


@dataclass(frozen=True)
class TokenLogprobs:
    """A picked token's log-probability and the most likely tokens' (id, log-probability), most likely
    first (ties: the lower id first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, token: int, num_top: int) -> TokenLogprobs:
    """log softmax(logits) [V] at ``token`` and its ``num_top`` largest entries, in float64."""
    x = logits.astype(np.float64)
    shifted = x - np.max(x)
    logprobs = shifted - np.log(np.sum(np.exp(shifted)))
    if num_top == 0:
        return TokenLogprobs(float(logprobs[token]))
    num_top = min(num_top, len(x))
    cut = -np.partition(-logprobs, num_top - 1)[num_top - 1]  # the num_top-th largest value
    above = np.flatnonzero(logprobs > cut)
    candidates = np.concatenate([above, np.flatnonzero(logprobs == cut)[:num_top - len(above)]])
    order = candidates[np.lexsort((candidates, -logprobs[candidates]))]
    return TokenLogprobs(float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in order))


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def greedy(logits: np.ndarray) -> int:
    """The highest logit; the lowest token id among equals. logits [V] -> token id."""
    return int(np.argmax(logits))


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> np.ndarray:
    """logits [V] -> a float32 copy with bias[token] added. A token id >= V is a ConfigError."""
    out = np.array(logits, dtype=np.float32)
    if not bias:
        return out
    ids = np.fromiter(bias.keys(), dtype=np.int64)
    check_bias_ids(ids, out.shape[0])
    out[ids] += np.fromiter(bias.values(), dtype=np.float32)
    return out


def check_bias_ids(ids: np.ndarray, vocab_size: int) -> None:
    """A biased token id outside [0, vocab_size) is a ConfigError naming it (the device adds at
    the ids it is given unchecked)."""
    outside = ids[(ids < 0) | (ids >= vocab_size)] if len(ids) else ids
    if len(outside):
        raise ConfigError(f"sampling parameter logit_bias names token {int(outside[0])}, "
                          f"but the vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1})")


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k highest logits (ties to the lower id), the rest become -inf. k = 0 keeps all."""
    if k == 0 or k >= logits.shape[0]:
        return logits
    kept = np.argsort(-logits, kind="stable")[:k]
    out = np.full_like(logits, -np.inf)
    out[kept] = logits[kept]
    return out


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability sums to >= p; others -inf."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = _softmax64(logits[order])
    num_kept = int(np.searchsorted(np.cumsum(probs), p)) + 1  # first prefix reaching p
    out = np.full_like(logits, -np.inf)
    kept = order[:num_kept]
    out[kept] = logits[kept]
    return out


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from logits [V] under params; greedy when temperature is 0 (or too small to divide by)."""
    if params.is_greedy:
        return greedy(apply_logit_bias(logits, params.logit_bias))
    return draw(distribution(logits, params), rng)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The float64 probabilities [V] that ``sample`` draws from (temperature > 0): bias, top-k,
    top-p, temperature; all mass on the greedy token where the temperature is too small to divide by."""
    masked = top_p_mask(top_k_mask(apply_logit_bias(logits, params.logit_bias), params.top_k), params.top_p)
    with np.errstate(over="ignore", divide="ignore"):
        tempered = masked / params.temperature
    if not np.isfinite(np.max(tempered)):  # a temperature so close to 0 that the logits overflow: its limit, greedy
        probs = np.zeros(logits.shape[0], dtype=np.float64)
        probs[greedy(masked)] = 1.0
        return probs
    return _softmax64(tempered)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from probabilities [V] (summing to about 1, or to any positive total)."""
    return _draw(probs, rng)


def _softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - np.max(x))
    return e / np.sum(e)


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw: one uniform number per token, so a seed fixes the whole sequence."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, int(np.flatnonzero(probs)[-1]))


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back only text that could still
    turn out to be the start of one."""

    def __init__(self, stop: tuple[str, ...]):
        self._stop = stop
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        buffered = self._pending + text
        starts = [buffered.find(s) for s in self._stop if s in buffered]
        if starts:
            self._pending = ""
            return buffered[: min(starts)], True
        num_held = max((_overlap(buffered, s) for s in self._stop), default=0)
        self._pending = buffered[len(buffered) - num_held:]
        return buffered[: len(buffered) - num_held], False

    def flush(self) -> str:
        """Held-back text, once the stream has ended without reaching a stop string."""
        text, self._pending = self._pending, ""
        return text


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
