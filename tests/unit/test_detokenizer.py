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


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_rust_decode_stream_sends_what_the_python_method_sends(tokenizer, skip_special_tokens):
    """HF tokenizers' DecodeStream (used for tokenizers with nothing to clean up) against the
    same method in Python (a tokenizer seen through its decode alone), step by step, with a step
    that adds several tokens at once."""
    import types

    from pagedkv import detokenizer

    assert detokenizer.DecodeStream is not None and detokenizer._plain_backend(tokenizer) is not None
    python_only = types.SimpleNamespace(decode=tokenizer.decode)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        streamed, reference = DetokenizerState(), DetokenizerState()
        for end in [*range(1, 6), *range(9, len(ids) + 1)]:
            ours = detokenize_incrementally(tokenizer, ids[:end], streamed, skip_special_tokens)
            theirs = detokenize_incrementally(python_only, ids[:end], reference, skip_special_tokens)
            assert ours == theirs, (text, end)
        assert streamed.stream and reference.stream is False  # (the stream, and the Python method)


def test_a_decode_stream_that_raises_hands_the_sequence_to_the_python_method(tokenizer):
    """tokenizers' DecodeStream may refuse a prefix (vLLM met "Invalid prefix encountered"): the
    sequence goes on with the Python method, its text whole, and the request is not failed."""
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    state = DetokenizerState()
    detokenize_incrementally(tokenizer, ids[:3], state, True)
    assert state.stream

    class Refusing:
        def step(self, backend, token_id):
            raise Exception("Invalid prefix encountered")

    state.stream = (Refusing(), state.stream[1])
    for end in range(4, len(ids) + 1):
        text = detokenize_incrementally(tokenizer, ids[:end], state, True)
        assert tokenizer.decode(ids[:end]).startswith(text)
    assert state.stream is False and text == tokenizer.decode(ids)


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
