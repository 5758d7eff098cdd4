"""IncrementalDetokenizer and find_stop against real tokenizers.

The byte-level BPE is the default model's (SmolLM2); the SentencePiece-style one is assembled from
the `tokenizers` library's own components exactly as Llama 2's tokenizer.json wires them (BPE with
byte fallback, then Replace("▁", " ") / ByteFallback / Fuse / Strip(" ", 1, 0)), trained here on
a small ASCII corpus so that accents, CJK and emoji go through ``<0xXX>`` byte tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.detokenizer import (
    HOLD_LIMIT,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopMatch,
    find_stop,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld — ñandú, façade, naïve, Ærøskøbing",
    "你好，世界。我们今天去公园散步吧！",
    "emoji: 😀🎉 👩‍👩‍👧‍👦 🇫🇷 ✔️ and more 🦀",
    "mixed 日本語 text with русский and العربية and हिन्दी",
    "  leading spaces,\ttabs\nnewlines\n\n and trailing  ",
    "code: def f(x):\n    return x ** 2  # → square",
    "combining: e\u0301 a\u0308 n\u0303 and zero width\u200bjoin",
]
SPECIALS = ["<unk>", "<s>", "</s>"]
HYPOTHESIS = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="module")
def smol_partial_ids(smol: Any) -> list[int]:
    """Tokens that are not whole characters on their own (pieces of multi-byte UTF-8)."""
    return [i for i in range(len(smol)) if REPLACEMENT_CHAR in smol.decode([i])]


@pytest.fixture(scope="module")
def llama_style() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a small corpus for testing the streaming of text.",
        "Streaming text must keep its spaces between words, and after punctuation!",
    ] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # training only
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # Llama's byte-fallback pieces are ordinary vocabulary entries
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.pre_tokenizer = None  # as in Llama 2: the normalizer alone marks word starts
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(
    tokenizer: Any, ids: Sequence[int], chunks: Sequence[int] = (), **kwargs: Any
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` in pieces of the given sizes (then one by one); return outputs + finish()."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces, i = [], 0
    for size in chunks:
        pieces.append(detok.add(ids[i : i + size]))
        i += size
    pieces.extend(detok.add([t]) for t in ids[i:])
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_real_text_token_by_token(smol: Any, text: str, skip: bool) -> None:
    ids = smol.encode(text)
    pieces, detok = stream(smol, ids, skip_special_tokens=skip)
    assert "".join(pieces) == smol.decode(ids, skip_special_tokens=skip) == text
    assert detok.text == text
    # an unfinished character is held back, never streamed as U+FFFD
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_emoji_split_over_byte_tokens_is_held_until_complete(smol: Any) -> None:
    ids = smol.encode("a😀")
    assert len(ids) >= 3  # "a", then the emoji's 4 bytes over more than one token
    detok = IncrementalDetokenizer(smol)
    assert detok.add(ids[:1]) == "a"
    for t in ids[1:-1]:
        assert detok.add([t]) == ""
    assert detok.text == "a"
    assert detok.add(ids[-1:]) == "😀"
    assert detok.finish() == ""
    assert detok.text == "a😀"


def test_finish_flushes_an_unfinished_character(smol: Any) -> None:
    ids = smol.encode("ok😀")[:-1]  # the emoji never completes
    pieces, detok = stream(smol, ids)
    assert pieces[-1] == smol.decode(ids)[len("ok") :]
    assert pieces[-1].endswith(REPLACEMENT_CHAR)
    assert detok.text == smol.decode(ids)
    assert detok.finish() == ""  # idempotent


def test_empty_add_and_special_tokens(smol: Any) -> None:
    detok = IncrementalDetokenizer(smol)
    assert detok.add([]) == ""
    im_start, im_end = smol.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start, *smol.encode("assistant\nHi"), im_end]
    assert "".join(stream(smol, ids)[0]) == "assistant\nHi"
    shown = "".join(stream(smol, ids, skip_special_tokens=False)[0])
    assert shown == smol.decode(ids) == "<|im_start|>assistant\nHi<|im_end|>"


@st.composite
def id_sequences(draw: st.DrawFn, vocab: int, partial: list[int]) -> list[int]:
    """Token ids biased towards the hard cases: pieces of characters and special tokens."""
    token = st.one_of(
        st.integers(0, vocab - 1), st.sampled_from(partial), st.integers(0, 16), st.just(216)
    )
    return draw(st.lists(token, max_size=40))


@given(data=st.data())
@HYPOTHESIS
def test_random_ids_match_full_decode(smol: Any, smol_partial_ids: list[int], data: Any) -> None:
    ids = data.draw(id_sequences(len(smol), smol_partial_ids))
    chunks = data.draw(st.lists(st.integers(0, 5), max_size=5))
    skip = data.draw(st.booleans())
    pieces, detok = stream(smol, ids, chunks, skip_special_tokens=skip)
    expected = smol.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == expected
    assert detok.text == expected


@given(text=st.text(max_size=60), chunks=st.lists(st.integers(1, 4), max_size=6))
@HYPOTHESIS
def test_random_text_round_trips(smol: Any, text: str, chunks: list[int]) -> None:
    ids = smol.encode(text)
    pieces, _ = stream(smol, ids, chunks)
    expected = smol.decode(ids)  # not always `text`: a few rare bytes are missing from the vocab
    assert "".join(pieces) == expected
    if REPLACEMENT_CHAR not in expected:
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_context_ids_are_context_only(smol: Any) -> None:
    prompt, output = smol.encode("The answer is"), smol.encode(" 42, 你好 😀")
    pieces, detok = stream(smol, output, context_ids=prompt)
    whole, head = smol.decode(prompt + output), smol.decode(prompt)
    assert "".join(pieces) == whole[len(head) :] == " 42, 你好 😀"
    assert detok.text == " 42, 你好 😀"


def test_context_ending_inside_a_character_is_dropped(smol: Any) -> None:
    ids = smol.encode("x😀 y")
    cut = next(i for i in range(1, len(ids)) if smol.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    pieces, _ = stream(smol, ids[cut:], context_ids=ids[:cut])
    assert "".join(pieces) == smol.decode(ids[cut:])


class CountingTokenizer:
    """Delegates decode, recording how many ids each call decoded."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_cost_per_add_is_bounded_by_the_window(smol: Any) -> None:
    ids = smol.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 2000
    counting = CountingTokenizer(smol)
    pieces, _ = stream(counting, ids)
    assert "".join(pieces) == smol.decode(ids)
    assert max(counting.sizes) <= 8  # a few tokens, not the whole output


def test_invalid_bytes_are_released_not_held_forever(smol: Any) -> None:
    # A lone continuation byte is never part of a character: the model emitting it over and over
    # must neither grow the window nor hold the text back until the end.
    lone = smol.convert_tokens_to_ids("Ģ")  # byte 0x80 in the byte-level alphabet
    assert smol.decode([lone]) == REPLACEMENT_CHAR
    ids = [lone] * 500 + smol.encode(" done")
    counting = CountingTokenizer(smol)
    detok = IncrementalDetokenizer(counting)
    streamed = [detok.add([t]) for t in ids[:500]]
    assert len("".join(streamed)) >= 500 - HOLD_LIMIT
    assert max(counting.sizes) <= 2 * HOLD_LIMIT
    streamed += [detok.add([t]) for t in ids[500:]] + [detok.finish()]
    assert "".join(streamed) == smol.decode(ids) == REPLACEMENT_CHAR * 500 + " done"


def test_long_runs_of_split_characters_added_in_chunks(smol: Any, llama_style: Any) -> None:
    # Every add ends inside a character, past HOLD_LIMIT held tokens: the release must stop at
    # the last finished character, not cut one in half (found by hypothesis).
    cases = [
        (smol, smol.encode("0\x80À𐀀𐀀𐀀")),
        (llama_style, llama_style("éé😀😀😀 ok").input_ids),
    ]
    for tokenizer, ids in cases:
        assert len(ids) > HOLD_LIMIT
        pieces, _ = stream(tokenizer, ids, [2, 2, 2, 4, 4])
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


# --------------------------------------------------------------------------- SentencePiece style


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_style_real_text(llama_style: Any, text: str) -> None:
    ids = llama_style(text).input_ids
    tokens = llama_style.convert_ids_to_tokens(ids)
    assert text.isascii() or any(t.startswith("<0x") for t in tokens)
    pieces, _ = stream(llama_style, ids)
    assert "".join(pieces) == llama_style.decode(ids, skip_special_tokens=True)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_sentencepiece_style_keeps_spaces_that_single_tokens_lose(llama_style: Any) -> None:
    ids = llama_style("Hello world fox", add_special_tokens=False).input_ids
    assert "".join(llama_style.decode([t]) for t in ids) != "Hello world fox"
    pieces, _ = stream(llama_style, ids)
    assert "".join(pieces) == "Hello world fox"


def test_sentencepiece_style_context_gives_the_first_token_its_space(llama_style: Any) -> None:
    prompt = llama_style("The answer").input_ids
    output = llama_style("is fox", add_special_tokens=False).input_ids  # "▁is", ...
    assert llama_style.decode(prompt + output, skip_special_tokens=True) == "The answer is fox"
    assert "".join(stream(llama_style, output)[0]) == "is fox"  # as decode(output) has it
    pieces, _ = stream(llama_style, output, context_ids=prompt)
    assert "".join(pieces) == " is fox"


@given(data=st.data())
@HYPOTHESIS
def test_sentencepiece_style_random_sequences(llama_style: Any, data: Any) -> None:
    # Whole words, special tokens and valid byte runs in random order. Invalid byte runs are
    # excluded: there the byte-fallback decoder is non-local (see IncrementalDetokenizer).
    byte_ids = {i for t, i in llama_style.get_vocab().items() if t.startswith("<0x")}
    words = sorted(set(range(len(llama_style))) - byte_ids)
    chars = st.sampled_from(["é", "你", "😀", "ñ", "—"]).map(
        lambda c: llama_style.convert_tokens_to_ids([f"<0x{b:02X}>" for b in c.encode()])
    )
    parts = data.draw(st.lists(st.one_of(st.sampled_from(words).map(lambda i: [i]), chars)))
    ids = [t for part in parts for t in part]
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=5))
    skip = data.draw(st.booleans())
    pieces, _ = stream(llama_style, ids, chunks, skip_special_tokens=skip)
    assert "".join(pieces) == llama_style.decode(ids, skip_special_tokens=skip)


def test_byte_fallback_keeps_characters_already_streamed(llama_style: Any) -> None:
    # Documented divergence: a later invalid byte makes the decoder turn the whole byte run into
    # U+FFFD, but "你" was complete, and streamed, before that byte arrived.
    nihao = llama_style.convert_tokens_to_ids(["<0xE4>", "<0xBD>", "<0xA0>"])
    bad = llama_style.convert_tokens_to_ids("<0x80>")
    detok = IncrementalDetokenizer(llama_style)
    assert "".join(detok.add([t]) for t in nihao) == "你"
    detok.add([bad])
    assert detok.finish() == REPLACEMENT_CHAR * 3
    assert llama_style.decode([*nihao, bad]) == REPLACEMENT_CHAR * 4


# --------------------------------------------------------------------------- find_stop


def test_find_stop_earliest_of_several() -> None:
    assert find_stop("say hello then bye", ["bye", "hello"], 0) == StopMatch(4, "hello")
    assert find_stop("nothing here", ["stop"], 0) is None
    assert find_stop("", ["x"], 0) is None
    assert StopMatch(4, "hello").end == 9


def test_find_stop_only_new_text_with_look_back() -> None:
    text = "abc STOP def ST"
    assert find_stop(text, ["STOP"], len("abc STOP")) is None  # ended before start: seen already
    assert find_stop(text, ["STOP"], len("abc STO")) == StopMatch(4, "STOP")  # straddles start
    assert find_stop(text + "OP", ["STOP"], len(text)) == StopMatch(13, "STOP")


def test_find_stop_tie_prefers_the_shorter() -> None:
    assert find_stop("x<end>", ["<end>", "<e"], 0) == StopMatch(1, "<e")


def naive_find_stop(text: str, stops: list[str], start: int) -> StopMatch | None:
    hits = [
        (p, len(s), s)
        for s in stops
        for p in range(len(text))
        if text.startswith(s, p) and p + len(s) > start
    ]
    return StopMatch(min(hits)[0], min(hits)[2]) if hits else None


@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=4),
    start=st.integers(0, 30),
)
@settings(max_examples=300, deadline=None)
def test_find_stop_matches_naive_search(text: str, stops: list[str], start: int) -> None:
    assert find_stop(text, stops, start) == naive_find_stop(text, stops, start)


def test_find_stop_incrementally_finds_what_a_whole_search_finds() -> None:
    chunks = ["The end", " is ne", "ar: ST", "OP now"]
    text, found = "", None
    for chunk in chunks:
        start, text = len(text), text + chunk
        found = find_stop(text, ["STOP", "xyz"], start)
        if found:
            break
    assert found == StopMatch("".join(chunks).index("STOP"), "STOP")
