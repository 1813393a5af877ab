"""`strata generate`: one prompt through the engine, streamed to stdout, timing line on stderr.

``run`` uses the configured backend (``numpy`` runs the reference ops on the CPU). ``generate_tokens``
is the same loop written directly over the NumPy reference forward: chunked prefill, then one token
at a time over the KV cache; the tests use it as the oracle for whole generations.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from strata.engine.sampling import SamplingParams, make_rng, sample
from strata.errors import ConfigError
from strata.model.chat import render_chat
from strata.model.reference import KVCache, ReferenceModel
from strata.model.tokenizer import Tokenizer

PREFILL_CHUNK_TOKENS = 256  # bounds the attention score matrix, [heads, chunk, context] float64


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_steps: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0

    def timing_line(self) -> str:
        prompt_rate = self.num_prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0
        decode_rate = self.num_decode_steps / self.decode_seconds if self.decode_seconds else 0.0
        return (f"prompt {self.num_prompt_tokens} tokens, generated {self.num_generated_tokens} tokens; "
                f"prompt {prompt_rate:.1f} tokens/s, decode {decode_rate:.1f} tokens/s (CPU, NumPy reference)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="text to continue (or the user message with --chat)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set reaching p (1: all)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: fresh entropy)")


def run(args: argparse.Namespace, config: Any, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Generate for args.prompt through the engine on the configured backend (``numpy``: the
    reference ops on the CPU); stream the text to ``out`` and the timing line to ``err``."""
    from strata.engine.facade import Engine

    out, err = out or sys.stdout, err or sys.stderr
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens)
    started = time.perf_counter()
    engine = Engine.load(config, show_progress=False)
    print(f"loaded {engine.model.path.name} on {engine.backend} in {time.perf_counter() - started:.2f} s", file=err)
    generation = engine.generate(encode_prompt(engine.tokenizer, args.prompt, args.chat).tolist(), params)
    for event in generation:
        out.write(event.text)
        out.flush()
    out.write("\n")
    print(generation.stats.timing_line(), file=err)
    return 0


def encode_prompt(tokenizer: Tokenizer, prompt: str, is_chat: bool) -> np.ndarray:
    """Plain prompts follow the model's BOS rule; chat prompts render the GGUF's template with
    one user message and the generation prompt, and parse the special tokens it writes."""
    if not is_chat:
        return np.asarray(tokenizer.encode(prompt), dtype=np.int64)
    if not tokenizer.chat_template:
        raise ConfigError("--chat needs a chat template, but the model's GGUF has no tokenizer.chat_template")
    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": prompt}], add_generation_prompt=True,
                       bos_token=_token_text(tokenizer, tokenizer.bos_id),
                       eos_token=_token_text(tokenizer, tokenizer.eos_id))
    return np.asarray(tokenizer.encode(text, parse_special=True), dtype=np.int64)


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token_piece(token_id).decode("utf-8", errors="replace")


def generate_tokens(model: ReferenceModel, prompt_tokens: np.ndarray, params: SamplingParams,
                    is_eog: Callable[[int], bool], stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield generated tokens until an end-of-generation token (not yielded), params.max_tokens,
    or the model's context is full. Fills stats as it goes."""
    stats = GenerationStats() if stats is None else stats
    num_prompt = len(prompt_tokens)
    context_length = model.spec.context_length
    if not 0 < num_prompt < context_length:
        raise ConfigError(f"the prompt has {num_prompt} tokens; it must have 1..{context_length - 1} "
                          f"(the model's context length is {context_length})")
    kv = KVCache.for_spec(model.spec, min(context_length, num_prompt + params.max_tokens))
    rng = make_rng(params.seed)
    stats.num_prompt_tokens = num_prompt

    started = time.perf_counter()
    for start in range(0, num_prompt, PREFILL_CHUNK_TOKENS):
        hidden = model.forward_hidden(prompt_tokens[start:start + PREFILL_CHUNK_TOKENS], start, kv)
    logits = model.logits(hidden[-1:])[0]  # [V]
    stats.prompt_seconds = time.perf_counter() - started

    position = num_prompt
    while True:
        token = sample(logits, params, rng)
        if is_eog(token):
            return
        stats.num_generated_tokens += 1
        yield token
        if stats.num_generated_tokens >= params.max_tokens or position >= kv.context_length:
            return
        started = time.perf_counter()
        logits = model.forward(np.array([token]), position, kv)[0]
        stats.decode_seconds += time.perf_counter() - started
        stats.num_decode_steps += 1
        position += 1
