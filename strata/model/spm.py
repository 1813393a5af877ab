"""SentencePiece tokenization as llama.cpp's `llm_tokenizer_spm` does it, from a GGUF's vocabulary and scores.

Not SentencePiece's own Unigram search: the text's characters are merged pairwise, always the
adjacent pair whose joined text is the vocabulary token of highest score (the leftmost of equal
scores), until no adjacent pair forms a token. A character left that is no token is written as
its UTF-8 bytes through the `<0xXX>` byte tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from strata.errors import ModelFormatError

SPACE_MARK = "\u2581"  # ▁, which stands for a space in the vocabulary's texts


class SpmModel:
    """Encodes raw text (no special tokens in it) to token ids; the caller adds the space prefix."""

    def __init__(self, texts: Sequence[str], scores: Sequence[float]):
        if len(scores) < len(texts):
            raise ModelFormatError(
                f"tokenizer.ggml.scores has {len(scores)} entries, expected one per token ({len(texts)}); "
                "a llama (SentencePiece) vocabulary merges by them"
            )
        # llama.cpp looks texts up in a map filled in id order, so of repeated texts the last id wins
        self._id_of_text: Mapping[str, int] = {text: i for i, text in enumerate(texts)}
        self._scores = [float(s) for s in scores[:len(texts)]]
        self._byte_ids = [self._byte_id(b) for b in range(256)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        symbols: list[str] = list(text.replace(" ", SPACE_MARK))
        num_symbols = len(symbols)
        next_of = [*range(1, num_symbols), -1]
        prev_of = list(range(-1, num_symbols - 1))
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, joined length)
        id_of_text, scores = self._id_of_text, self._scores

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = symbols[left] + symbols[right]
            token_id = id_of_text.get(joined)
            if token_id is not None:
                heapq.heappush(queue, (-scores[token_id], left, right, len(joined)))

        for right in range(1, num_symbols):
            push(right - 1, right)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            left_text, right_text = symbols[left], symbols[right]
            if not left_text or not right_text or len(left_text) + len(right_text) != length:
                continue  # one side was merged since this pair was queued
            symbols[left], symbols[right] = left_text + right_text, ""
            next_of[left] = next_of[right]
            if next_of[right] >= 0:
                prev_of[next_of[right]] = left
            push(prev_of[left], left)
            push(left, next_of[left])

        ids: list[int] = []
        index = 0
        while index >= 0:
            symbol = symbols[index]
            token_id = id_of_text.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(self._byte_token(b, symbol) for b in symbol.encode("utf-8", "surrogateescape"))
            index = next_of[index]
        return ids

    def _byte_id(self, byte: int) -> int | None:
        """llama.cpp's `byte_to_token`: the `<0xXX>` token, else a token whose text is the byte itself."""
        found = self._id_of_text.get(f"<0x{byte:02X}>")
        if found is None:
            found = self._id_of_text.get(bytes([byte]).decode("utf-8", "surrogateescape"))
        return found

    def _byte_token(self, byte: int, symbol: str) -> int:
        token_id = self._byte_ids[byte]
        if token_id is None:
            raise ModelFormatError(
                f"{symbol!r} is not in the vocabulary and it has no byte token <0x{byte:02X}> to spell it with; "
                "the GGUF's SentencePiece vocabulary lacks byte fallback (convert it with its byte tokens)"
            )
        return token_id
