"""A small real byte-level BPE vocabulary for synthetic models, trained at write time.

The vocabulary is Qwen2-shaped so the GGUF's tokenizer metadata is what llama.cpp's converter
writes for Qwen3: `tokenizer.ggml.model = gpt2`, `pre = qwen2`, byte-level token strings, merges
as "left right", ChatML special tokens after the trained tokens, and `[PAD{i}]` tokens of type
UNUSED up to the model's vocabulary size (so the output head has the real size).
Training is deterministic: the same vocabulary size gives the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gguf import TokenType
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_TRAINED_TOKENS = 4096
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The morning train left the station at a quarter past seven, and the fields outside were still grey with frost.
A small river runs through the middle of the town; in summer the children swim there, and in winter it freezes.
She opened the window, listened to the birds for a while, and then went back to reading her book about the sea.
Prices rose by 3.5 percent in March, while wages grew by only 2 percent over the same twelve months.
The committee will meet again on Tuesday, 14 May, to decide whether the new bridge should be built of steel or stone.
If you want to learn a language quickly, speak it every day, read simple stories, and do not be afraid of mistakes.
Bread, cheese, apples and a bottle of water: that was all they carried when they walked up into the mountains.
The computer stores numbers as bits; eight bits make a byte, and a thousand bytes make roughly one kilobyte.
Once upon a time there was an old fisherman who lived with his wife in a little hut close to the shore.
Scientists measured the temperature of the lake every hour and found that it changed much more slowly than the air.
"Where are you going?" asked the teacher. "To the library," answered the boy, "because my report is due tomorrow."
Good software is written twice: once to understand the problem, and once more to solve it cleanly.
The capital of France is Paris, the capital of Italy is Rome, and the capital of Japan is Tokyo.
Heavy rain is expected tonight in the north, with strong winds near the coast and snow on the higher hills.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))
The museum opens at nine o'clock and closes at five, except on Mondays, when it is closed all day.
He didn't know the answer, but he'd read enough to make a good guess, and it turned out he was right.
We're going to need more chairs, more plates, and at least two more tables before the guests arrive.
Water boils at 100 degrees Celsius at sea level, but at lower temperatures high up in the mountains.
The orchestra played for nearly two hours, and when the music stopped the whole hall stood up to applaud.
Every language has its own rhythm; poets notice it first, and everyone else learns it without noticing.
Please remember to turn off the lights, lock the door, and leave the key with the neighbour downstairs.
In 1969 two astronauts walked on the Moon while a third one waited for them in orbit above.
The recipe calls for two cups of flour, one egg, a pinch of salt, and enough milk to make a smooth batter.
Traffic was light on the highway, so they reached the city before noon and found a quiet place for lunch.
"""


@dataclass(frozen=True)
class SynthVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    chat_template: str


def num_trained_tokens(vocab_size: int) -> int:
    """How many tokens BPE training is asked for (the trainer may stop earlier on this corpus)."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"a byte-level vocabulary needs at least {minimum} tokens, got vocab_size={vocab_size}")
    return min(vocab_size - len(SPECIAL_TOKENS), MAX_TRAINED_TOKENS)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """The HF tokenizer whose ids match `build_vocab(vocab_size)` (special tokens excluded)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_trained_tokens(vocab_size),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


def build_vocab(vocab_size: int) -> SynthVocab:
    """Trained tokens, then the ChatML specials, then UNUSED padding up to `vocab_size`."""
    tokenizer = train_tokenizer(vocab_size)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in by_id]
    if [i for _, i in by_id] != list(range(len(tokens))):
        raise RuntimeError("trained BPE ids are not contiguous")
    merges = [" ".join(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
    types = [int(TokenType.NORMAL)] * len(tokens)
    first_special = len(tokens)
    tokens += SPECIAL_TOKENS
    types += [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    types += [int(TokenType.UNUSED)] * (vocab_size - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    return SynthVocab(
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=first_special,  # <|endoftext|>, as Qwen's GGUFs have it
        eos_id=first_special + 2,  # <|im_end|>
        pad_id=first_special,
        chat_template=CHAT_TEMPLATE,
    )
