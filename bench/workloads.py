"""Prompts of exact token lengths, the same for every system under test.

Prompts are plain text so that every server tokenizes them itself, through the
checkpoint's own tokenizer, exactly as a client's text would be. Each text is
built word by word until ``tokenizer(text)`` has exactly the asked number of
ids, so "128 prompt tokens" means 128 on every server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# common English words: realistic merges for a byte-level BPE, no rare bytes
WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but be have one "
    "which you were all she there their an been has when who will more no if out so said what up its about "
    "into than them can only other new some time could these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three garden river city music letter window "
    "morning evening paper stone market winter summer train station bread table story answer question"
).split()
FILLERS = (" a", " I", " x", ".", ",")


def text_with_tokens(tokenizer, length: int, rng: random.Random) -> str:
    """Random words whose tokenization (``tokenizer(text)``, special tokens included) is exactly ``length`` ids."""

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    words: list[str] = []
    while True:
        candidate = words + [rng.choice(WORDS)]
        if count(" ".join(candidate)) > length:
            break
        words = candidate
    text = " ".join(words)
    while count(text) < length:
        for filler in FILLERS:
            if count(text + filler) <= length:
                text += filler
                break
        else:
            raise ValueError(f"cannot reach exactly {length} tokens with this tokenizer")
    return text


@dataclass(frozen=True)
class Request:
    """One completion request: the same text, length and settings for every system."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


def throughput_requests(tokenizer, count: int, prompt_len: int, output_len: int, seed: int) -> list[Request]:
    """``count`` distinct prompts; a new ``seed`` per run keeps one run's prefixes out of the next one's cache."""
    rng = random.Random(seed)
    return [Request(text_with_tokens(tokenizer, prompt_len, rng), prompt_len, output_len) for _ in range(count)]


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat replayed with fixed turns: prompt ``t`` is the system prompt plus the history up to turn ``t``."""

    system: str
    users: tuple[str, ...]
    assistants: tuple[str, ...]

    def prompt(self, turn: int) -> str:
        history = "".join(f"\nUser: {self.users[i]}\nAssistant: {self.assistants[i]}" for i in range(turn))
        return f"{self.system}{history}\nUser: {self.users[turn]}\nAssistant:"


def shared_prefix_conversations(
    tokenizer, conversations: int, turns: int, prefix_len: int, turn_len: int, seed: int = 7
) -> tuple[str, list[Conversation]]:
    """A ``prefix_len``-token system prompt shared by ``conversations`` chats of ``turns`` turns.

    Assistant turns are fixed text rather than model output, so the workload is
    identical whatever a server generates.
    """
    rng = random.Random(seed)
    system = text_with_tokens(tokenizer, prefix_len, rng)
    chats = []
    for _ in range(conversations):
        users = tuple(text_with_tokens(tokenizer, turn_len, rng) for _ in range(turns))
        assistants = tuple(text_with_tokens(tokenizer, turn_len, rng) for _ in range(turns))
        chats.append(Conversation(system, users, assistants))
    return system, chats
