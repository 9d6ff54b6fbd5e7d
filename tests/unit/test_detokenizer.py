"""Incremental detokenization against whole decodes, with the embedded SmolLM2 tokenizer
(byte-level BPE: multi-byte characters are split across tokens)."""

import pytest

from pagedkv.detokenizer import DetokenizerState, detokenize_final, detokenize_incrementally

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji 😀🎉 and CJK 漢字かな mixed with ASCII, then ☃ snow.",
    "  leading spaces, tabs\tand\nnew lines\n\n  indented",
    "def f(x):\n    return x ** 2  # ÷ × ± ≤ ≥",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    directory, name = smollm2
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_grows_into_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids) or text.isascii()
    state = DetokenizerState()
    previous = ""
    for end in range(1, len(ids) + 1):
        current = detokenize_incrementally(tokenizer, ids[:end], state, skip_special_tokens=True)
        assert current.startswith(previous)  # a stream only appends
        assert "\ufffd" not in current  # a split character is held back, not sent broken
        assert tokenizer.decode(ids[:end]).startswith(current)
        previous = current
    assert previous == tokenizer.decode(ids) == text


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    ids = ids[:1] + [tokenizer.eos_token_id] + ids[1:]
    for skip in (True, False):
        state = DetokenizerState()
        for end in range(1, len(ids) + 1):
            text = detokenize_incrementally(tokenizer, ids[:end], state, skip_special_tokens=skip)
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_calls_without_new_tokens_decode_nothing(tokenizer):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(list(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode("one two three", add_special_tokens=False)
    state = DetokenizerState()
    detokenize_incrementally(Counting(), ids, state, True)
    count = len(calls)
    assert detokenize_incrementally(Counting(), ids, state, True) == tokenizer.decode(ids)
    assert len(calls) == count
    for _ in range(3):  # a finished sequence is decoded whole once, however often it is reported
        assert detokenize_final(Counting(), ids, state, True) == tokenizer.decode(ids)
    assert len(calls) == count + 1


def test_the_backend_decode_is_the_tokenizers_own(tokenizer):
    from pagedkv.detokenizer import fast_decode

    assert fast_decode(tokenizer) == tokenizer.backend_tokenizer.decode  # (no space clean-up to apply)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        for end in range(len(ids) + 1):
            for skip in (True, False):
                assert fast_decode(tokenizer)(ids[:end], skip_special_tokens=skip) == tokenizer.decode(
                    ids[:end], skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer):
    from pagedkv.detokenizer import fast_decode

    original, tokenizer.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces, True
    try:
        assert fast_decode(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = original
