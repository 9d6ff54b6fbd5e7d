"""Incremental detokenization against whole decodes, with the embedded SmolLM2 tokenizer
(byte-level BPE: multi-byte characters are split across tokens)."""

import pytest

from pagedkv.engine.detokenizer import DetokenizerState, detokenize_final, detokenize_incrementally

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji 😀🎉 and CJK 漢字かな mixed with ASCII, then ☃ snow.",
    "  leading spaces, tabs\tand\nnew lines\n\n  indented",
    "def f(x):\n    return x ** 2  # ÷ × ± ≤ ≥",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


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

    from pagedkv.engine import detokenizer

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
    from pagedkv.engine.detokenizer import fast_decode

    assert fast_decode(tokenizer) == tokenizer.backend_tokenizer.decode  # (no space clean-up to apply)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        for end in range(len(ids) + 1):
            for skip in (True, False):
                assert fast_decode(tokenizer)(ids[:end], skip_special_tokens=skip) == tokenizer.decode(
                    ids[:end], skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer):
    from pagedkv.engine.detokenizer import fast_decode

    original, tokenizer.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces, True
    try:
        assert fast_decode(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = original


@pytest.mark.parametrize("stop", [[], ["never in it"]])
@pytest.mark.parametrize("output_kind", ["delta", "cumulative"])
def test_a_streamed_sequence_text_has_one_reference_while_it_grows(tokenizer, output_kind, stop):
    """The engine keeps the decode so far in the detokenizer's state alone (`SequenceState.text`
    is set when the sequence ends): `+=` then extends the string in place instead of copying the
    whole text at every token. Delta outputs hold only the new text; what the outputs add up to,
    or the last cumulative one, is the whole decode."""
    import sys

    from pagedkv.outputs import RequestMetrics
    from pagedkv.engine.request_state import RequestState, SequenceState
    from pagedkv.params.sampling import SamplingParams

    ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    seq = SequenceState(seq_id=0, index=0)
    request = RequestState("r", None, [1], SamplingParams(max_tokens=10_000, stop=stop, output_kind=output_kind),
                           RequestMetrics(0.0), [seq], forked=True)
    sent = ""
    for token_id in ids:
        request.record_token(seq, token_id, None, None, tokenizer, frozenset(), 100_000)
        output = request.to_output(tokenizer).outputs[0]
        sent = sent + output.text if output_kind == "delta" else output.text
        text = seq.detokenizer.text
        if output_kind == "delta":  # (the state's, `text` and the call's argument; and this test's own)
            assert sys.getrefcount(text) - (output.text is text) - (sent is text) == 3
    assert sent == tokenizer.decode(ids)[: len(sent)] and len(sent) >= len(tokenizer.decode(ids)) - len("never in it")
    assert seq.text_so_far == seq.detokenizer.text == tokenizer.decode(ids)


@pytest.mark.parametrize("stop", [[], ["brown"]])
def test_text_so_far_of_a_sequence_that_ended_before_it_was_reported(tokenizer, stop):
    """A sequence that ends (by length here, or at a stop string) in the step that then fails
    keeps the text it had (what a failed request reports), not an empty one."""
    from pagedkv.outputs import RequestMetrics
    from pagedkv.engine.request_state import RequestState, SequenceState
    from pagedkv.params.sampling import SamplingParams

    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    seq = SequenceState(seq_id=0, index=0)
    request = RequestState("r", None, [1], SamplingParams(max_tokens=len(ids), stop=stop), RequestMetrics(0.0),
                           [seq], forked=True)
    for token_id in ids[:-1]:
        request.record_token(seq, token_id, None, None, tokenizer, frozenset(), 10_000)
        if seq.finished:
            break
        request.to_output(tokenizer)
    else:
        request.record_token(seq, ids[-1], None, None, tokenizer, frozenset(), 10_000)
    assert seq.finished
    expected = TEXTS[0][: TEXTS[0].index("brown")] if stop else tokenizer.decode(ids[:-1])
    assert seq.text_so_far == expected
