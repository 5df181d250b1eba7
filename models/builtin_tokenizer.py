"""The embedded models' tokenizer: byte-level BPE trained here on a fixed corpus, with a ChatML template.

The same bytes on every run and every machine, so checkpoints written from it
(and their cache fingerprints) are reproducible; nothing is downloaded.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

MODEL_MAX_LENGTH = 512  # the builtin architectures' max_position_embeddings

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
#: In id order: the trainer gives special tokens the first ids, so bos=0,
#: eos=1, im_start=2, im_end=3, pad=4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
TARGET_VOCAB_SIZE = 2048

#: ChatML. Content may be a string or a list of OpenAI-style parts, of which
#: the text parts are joined. No bos token is emitted (Qwen-style).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

#: The tokenizer's training text. Editing it changes every builtin's cache
#: directory (its hash is part of the spec hash).
CORPUS = """\
The morning train to the coast was late again, and nobody on the platform seemed surprised.
A woman in a green coat read the timetable twice, then folded her newspaper and sighed.
"It's always the same," she said to the man beside her. "Ten minutes, they say, and then it's forty."
"At least the coffee is good," he answered, lifting a paper cup. "The café across the street opens at six."
She laughed. "You're naïve if you think that coffee is good. It's warm, which is a different thing."

When the train finally arrived, the carriages were nearly empty. Light came through the windows in long
yellow bands, and the fields outside were covered with frost. A child counted the cows: one, two, three,
four, five, and then gave up because there were too many of them. Her father smiled and wrote the number
12 in the margin of his notebook, next to a list of things he had promised to buy: bread, milk, eggs,
batteries, string, and a birthday card for his sister, who would be thirty-seven on Thursday.

Chapter 2. The Lighthouse

The lighthouse keeper had lived alone for eleven years. Every evening he climbed the ninety-nine steps,
cleaned the lens, wound the clockwork, and wrote a single line in the logbook. Most lines were short:
"Wind from the west. Calm sea." "Fog until noon." "A gull stole my sandwich." On the last page of the
oldest book someone had written, in careful letters, a sentence he read whenever he felt tired:
"We keep the light so that others may find their way home."

Q: What is the capital of France?
A: The capital of France is Paris.
Q: How many days are there in a week?
A: There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
Q: Why is the sky blue?
A: Sunlight is scattered by the molecules of the air, and blue light is scattered more than red light,
so the sky looks blue during the day and red or orange at sunrise and sunset.
Q: Can you help me write a poem?
A: Of course! Tell me the subject, the mood, and how long you would like it to be.

User: Hello! Could you summarise this article for me?
Assistant: Sure. The article explains how caching works in large language model servers. When a prompt
shares a prefix with an earlier prompt, the server can reuse the attention keys and values it already
computed, which makes the first token arrive much sooner. The author measures the speed-up and finds
that it grows with the length of the shared prefix.
User: Thanks. What are the main risks?
Assistant: The main risks are memory pressure, stale entries after a model update, and mixing up the
caches of different tenants. Each entry should therefore carry a fingerprint of the model and a salt.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Cache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self.entries: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.entries.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self.entries) >= self.capacity:
            oldest = next(iter(self.entries))
            del self.entries[oldest]
        self.entries[key] = value


for i in range(10):
    print(f"step {i}: loss={1.0 / (i + 1):.4f}")

SELECT name, count(*) AS total FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY total DESC;
{"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
$ pip install tierserve && tierserve serve --preset development --port 8000
if (x > 0 && y < 10) { return x * y; } else { return -1; }

A short history of numbers: people counted on their fingers, then with pebbles, then with marks on
clay tablets. The Babylonians used base sixty, which is why an hour has sixty minutes and a circle has
360 degrees. Zero arrived much later. Today a computer stores every number as bits, ones and zeros,
and a single modern chip performs billions of additions every second.

Recipe: Simple tomato soup (serves 4)
- 1 kg ripe tomatoes, chopped
- 2 onions and 3 cloves of garlic
- 500 ml vegetable stock, a pinch of salt, black pepper, and fresh basil
Fry the onions gently for ten minutes. Add the garlic, then the tomatoes and the stock. Simmer for
twenty-five minutes, blend until smooth, and season to taste. Serve with crusty bread.

Dear Sam,
Thank you for your letter. I was glad to hear that the new job is going well and that the office is
close to the river. We are all fine here. The garden is full of roses this year, and the old apple
tree has finally produced more than three apples. Write again soon!
Best wishes,
Alex

Travel notes. In Tokyo the signs say 日本語 and 東京駅, and the trains run exactly on time. In Paris we
ate crêpes and crème brûlée at a tiny café near the Seine; the waiter called everyone "monsieur" or
"madame". In München the beer gardens were crowded; in Zürich the lake was cold and clear. In Москва
the winter was long. Our friend José from São Paulo sent a photo 📷 of the beach 🏖️ and a message:
"Saudações! 😊" The résumé I wrote last week still needs a better introduction. Prices: €12.50, £9,
¥1200, and $15 — roughly the same, more or less. The temperature was −3 °C; the distance was ½ mile.
Emoji are fun: 🚀 ✨ 🎉 👍 ❤️ 🙂.

Why do we dream? Scientists are not entirely sure. Some believe dreams help us sort memories, keeping
what matters and forgetting what does not. Others think they are simply noise from a brain that never
quite switches off. Either way, most people forget their dreams within minutes of waking, unless they
write them down immediately.

"Are you coming?" asked Maria.
"In a minute," said Tom. "I can't find my keys."
"They're on the table, next to your phone."
"Oh. Right. Thank you!"
"You would lose your head if it weren't attached to your shoulders."

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick
daft zebras jump! Sphinx of black quartz, judge my vow. These sentences use every letter of the alphabet,
which makes them useful for testing fonts, keyboards and, apparently, tokenizers.

Rules of the game: each player starts with seven cards. On your turn, draw one card, then either play a
card that matches the colour or the number of the top card, or pass. The first player to empty their
hand wins the round. Scores are the sum of the cards left in the other players' hands.

Museum guide, room 4: The painting on your left shows a harbour at dusk. Notice how the painter used
only three colours — ochre, umber and a pale grey-blue — yet the water seems to shimmer. The artist
was self-taught, worked as a sailmaker for most of his life, and sold just one picture before he died.
Visitors often ask why the boats have no sailors. Historians disagree; perhaps the crews had gone
ashore for the festival that the small lanterns in the background suggest.

Weather forecast: tomorrow begins cloudy with scattered showers in the north, brightening by the
afternoon. Highs of 14 to 17 degrees, lows near 6 overnight. Strong gusts along exposed coasts,
easing later. The weekend looks drier and warmer, although thunderstorms may develop inland on Sunday.

Interview notes. Candidate explained a binary search tree clearly, wrote a correct merge sort, and
asked thoughtful questions about on-call rotations, code review, testing culture and documentation.
Strengths: communication, curiosity, patience. Concerns: limited experience with distributed systems
and databases; suggested a follow-up conversation with the infrastructure team next Wednesday.

Astronomy club minutes: Jupiter and Saturn were visible low in the south-east after midnight. Priya
brought her new telescope; Omar photographed the Moon's craters and the Orion nebula. Next meeting:
bring warm gloves, a red torch, hot chocolate and star charts. Membership fees remain unchanged.

Error: file not found: /home/user/data/config.toml (check the path and try again)
Warning: 3 requests were retried after a timeout of 30 seconds.
INFO 2024-05-01 12:00:00 server started on http://127.0.0.1:8000
"""


#: Qwen2's split pattern, and the same byte-level set-up as its tokenizer
#: class: transformers' ``AutoTokenizer`` rebuilds a qwen2 checkpoint's
#: tokenizer from vocab + merges with exactly this pre-tokenizer (plus NFC),
#: so using it everywhere keeps every checkpoint's tokenizer identical to
#: what ``AutoTokenizer`` loads.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_level_tokenizer(model: Any, nfc: bool) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    tokenizer = Tokenizer(model)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = _byte_level_tokenizer(models.BPE(), nfc=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any UTF-8 text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(*, nfc: bool = False) -> Any:
    """Return the builtin tokenizer as a fresh ``PreTrainedTokenizerFast``.

    Byte-level BPE (vocab ``TARGET_VOCAB_SIZE``) trained on ``CORPUS``; the
    same bytes on every run. Encoding adds no special tokens — neither bos nor
    eos — with or without ``add_special_tokens``, and the ChatML
    ``chat_template`` does not emit bos either. bos/eos/pad are set
    (``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|pad|>``) for callers
    that want them.

    Args:
        nfc: NFC-normalise input, as transformers' Qwen2 tokenizer class always
            does. Without it ``decode(encode(t)) == t`` for any text ``t`` that
            contains no special-token strings; with it, for any NFC text.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer.from_str(_trained_bpe_json())
    backend = _byte_level_tokenizer(trained.model, nfc)
    for token in SPECIAL_TOKENS:
        backend.add_special_tokens([token])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
