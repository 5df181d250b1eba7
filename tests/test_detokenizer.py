"""Incremental detokenizer: streamed text equals a full decode, UTF-8 safety, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tierserve.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit

EOS = "<|endoftext|>"
CORPUS = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Streaming text arrives one token at a time; stop strings end it early.",
    "Serving language models is mostly about caching keys and values.",
]


@cache
def byte_bpe() -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on English only, so non-ASCII text splits into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, clean_up_tokenization_spaces=False)


@cache
def metaspace_bpe() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: '▁' marks spaces and a decode strips the first one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=[EOS]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, clean_up_tokenization_spaces=False)


def stream(tokenizer, output: list[int], prompt: Sequence[int] = (), chunks: list[int] | None = None, **kwargs) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed ``output`` in chunks of the given sizes (default one token); return deltas, flush text, detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    i = 0
    for size in chunks or [1] * len(output):
        deltas.append(detok.add(output[i : i + size]).text)
        i += size
    if i < len(output):
        deltas.append(detok.add(output[i:]).text)
    return deltas, detok.flush(), detok


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


token_ids = st.lists(st.integers(0, 319), max_size=40)


@settings(max_examples=300, deadline=None)
@given(output=token_ids, prompt=st.lists(st.integers(0, 319), max_size=8), chunks=st.lists(st.integers(1, 4), max_size=40), skip=st.booleans())
def test_streamed_text_equals_full_decode(output, prompt, chunks, skip):
    tok = byte_bpe()
    full = decode(tok, output, skip)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    emitted = ""
    i = 0
    for size in [*chunks, len(output)]:
        if i >= len(output):
            break
        delta = detok.add(output[i : i + size])
        i += size
        assert not delta.stopped
        emitted += delta.text
        # Whatever was released is final: the full decode starts with it.
        assert full.startswith(emitted)
        assert detok.text == emitted
    assert emitted + detok.flush() == full


@settings(max_examples=150, deadline=None)
@given(output=st.lists(st.integers(0, 199), max_size=30), prompt=st.lists(st.integers(0, 199), max_size=8), chunk=st.integers(1, 3))
def test_metaspace_stream_continues_the_prompt_text(output, prompt, chunk):
    tok = metaspace_bpe()
    deltas, tail, _ = stream(tok, output, prompt=prompt, chunks=[chunk] * len(output))
    # The stream is what the output adds to the decoded prompt, leading space included.
    prompt_text = decode(tok, prompt)
    together = decode(tok, prompt + output)
    assert together.startswith(prompt_text)
    assert "".join(deltas) + tail == together[len(prompt_text) :]


def test_metaspace_stream_after_a_prompt_ending_in_special_tokens():
    """Found by hypothesis: the prompt's last tokens were all special (decoded to nothing), so the output's first
    word lost the space that separates it from the prompt's text."""
    tok = metaspace_bpe()
    prompt, output = [1, 0, 0, 0, 0, 0], [125]  # ".", five end-of-text tokens; then "▁Strea"
    deltas, tail, _ = stream(tok, output, prompt=prompt)
    assert "".join(deltas) + tail == decode(tok, prompt + output)[len(decode(tok, prompt)) :] == " Strea"


def test_non_ascii_streams_without_replacement_characters():
    tok = byte_bpe()
    text = "café 日本語 🙂 naïve"
    ids = tok.encode(text)
    # The tokenizer never saw these characters, so they are split into byte tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, tail, detok = stream(tok, ids, prompt=tok.encode("Hello world."))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert tail == ""
    assert detok.text == text


def test_character_split_across_prompt_and_output():
    tok = byte_bpe()
    ids = tok.encode("a 🙂")
    # The emoji's bytes start in the prompt and end in the output; the output alone decodes to U+FFFD.
    prompt, output = ids[:-2], ids[-2:]
    deltas, tail, _ = stream(tok, output, prompt=prompt)
    assert "".join(deltas) + tail == tok.decode(output)


def test_incomplete_character_at_the_end_is_flushed_like_decode():
    tok = byte_bpe()
    ids = tok.encode("ok 日")[:-1]  # drop the character's last byte
    deltas, tail, _ = stream(tok, ids)
    assert "".join(deltas) == "ok "
    assert tail == "\ufffd"
    assert "".join(deltas) + tail == tok.decode(ids)


def test_settled_text_before_an_unfinished_character_is_not_held():
    tok = byte_bpe()
    ids = tok.encode("ok 日")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:-1]).text == "ok "
    assert detok.add(ids[-1:]).text == "日"


def test_skip_special_tokens():
    tok = byte_bpe()
    eos = tok.convert_tokens_to_ids(EOS)
    ids = [*tok.encode("Hello"), eos, *tok.encode(" world")]
    assert "".join(stream(tok, ids)[0]) == "Hello world"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == f"Hello{EOS} world"


def test_prompt_context_keeps_the_space_before_the_output():
    tok = metaspace_bpe()
    prompt = tok.encode("Hello")
    output = tok.encode("Hello world")[len(prompt) :]
    assert tok.decode(output) == "world"  # decoding the output alone strips its leading space
    deltas, tail, _ = stream(tok, output, prompt=prompt)
    assert "".join(deltas) + tail == " world"
    # Without a prompt the first token's space is stripped, as decode() does.
    assert "".join(stream(tok, tok.encode("Hello world"))[0]) == "Hello world"


def test_stop_string_across_token_boundaries():
    tok = byte_bpe()
    ids = tok.encode("Hello world. STOP here")
    stop_start = len(tok.encode("Hello world. "))
    assert len(tok.encode("STOP")) > 1
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = []
    for n, i in enumerate(ids):
        delta = detok.add([i])
        deltas.append(delta.text)
        if delta.stopped:
            break
    assert delta.stopped and delta.stop_reason == "STOP"
    assert "".join(deltas) == "Hello world. "
    assert detok.text == "Hello world. "
    assert n < len(ids) - 1 and n >= stop_start
    # Later tokens are ignored.
    assert detok.add(ids[-1:]).text == ""
    assert detok.add(ids[-1:]).stopped
    assert detok.flush() == ""


def test_include_stop_str_in_output():
    tok = byte_bpe()
    deltas, tail, detok = stream(tok, tok.encode("Hello world. STOP here"), stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) + tail == "Hello world. STOP"
    assert detok.stop_reason == "STOP"


def test_earliest_stop_string_wins():
    tok = byte_bpe()
    ids = tok.encode("Hello world, the quick fox")
    deltas, tail, detok = stream(tok, ids, stop=["quick", "world", "fox"])
    assert "".join(deltas) + tail == "Hello "
    assert detok.stop_reason == "world"


@pytest.mark.parametrize("chunks", [None, [100]])
def test_first_completed_stop_string_wins_whatever_the_chunking(chunks):
    tok = byte_bpe()
    # "bc" completes before "abcd" does, though "abcd" starts earlier.
    deltas, tail, detok = stream(tok, tok.encode("xabcdy"), chunks=chunks, stop=["abcd", "bc"])
    assert "".join(deltas) + tail == "xa"
    assert detok.stop_reason == "bc"


def test_stop_string_is_never_emitted_partially():
    tok = byte_bpe()
    text = "The STORE is not a STOP sign"
    expected = "The STORE is not a "
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    emitted = ""
    for i in tok.encode(text):
        delta = detok.add([i])
        emitted += delta.text
        assert expected.startswith(emitted)
        if delta.stopped:
            break
    assert emitted == expected


def test_text_is_held_back_only_while_it_could_start_a_stop_string():
    tok = byte_bpe()
    detok = IncrementalDetokenizer(tok, [], stop=["END!"])
    assert detok.add(tok.encode("Hello world")).text == "Hello world"
    assert detok.add(tok.encode(" EN")).text == " "
    assert detok.add(tok.encode("D")).text == ""
    assert detok.add(tok.encode("s")).text == "ENDs"


def test_flush_releases_text_held_for_a_possible_stop_string():
    tok = byte_bpe()
    deltas, tail, detok = stream(tok, tok.encode("Hello ST"), stop=["STOP"])
    assert "".join(deltas) == "Hello "
    assert tail == "ST"
    assert detok.text == "Hello ST"
    assert detok.stop_reason is None
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match="flush"):
        detok.add(tok.encode("x"))


def test_flush_still_truncates_at_a_stop_string():
    tok = byte_bpe()
    # The stop string is followed by an unfinished character, so it is only seen at flush.
    ids = tok.encode("ab STOP 日")[:-1]
    deltas, tail, detok = stream(tok, ids, stop=["STOP"])
    assert "".join(deltas) + tail == "ab "
    assert detok.stop_reason == "STOP"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 3), max_size=30),
)
def test_stop_strings_match_a_reference_on_the_full_text(text, stops, chunks):
    tok = byte_bpe()
    ids = tok.encode(text)
    # Reference: cut at the stop occurrence that ends first (longer on a tie).
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    expected, reason = text, None
    if hits:
        end, neg_len, reason = min(hits)
        expected = text[: end + neg_len]
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    emitted = ""
    i = 0
    for size in [*chunks, len(ids)]:
        if i >= len(ids):
            break
        delta = detok.add(ids[i : i + size])
        i += size
        emitted += delta.text
        assert expected.startswith(emitted)
        if delta.stopped:
            break
    emitted += detok.flush()
    assert emitted == expected
    assert detok.stop_reason == reason


def test_raw_tokenizers_tokenizer_is_accepted():
    raw = byte_bpe().backend_tokenizer
    ids = raw.encode("naïve café").ids
    deltas, tail, _ = stream(raw, ids)
    assert "".join(deltas) + tail == "naïve café"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(byte_bpe(), [], stop=[""])
