"""Structured outputs (xgrammar): JSON schema, any JSON, regex, choice and EBNF grammar
constraints on the embedded SmolLM2, greedy and sampled."""

import json
import re

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.params.structured_output import GrammarCompiler, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_device_blocks=128, max_model_len=512)


def chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)


def generate(llm, prompt, constraint, **params):
    params = SamplingParams(max_tokens=params.pop("max_tokens", 48), structured_outputs=constraint, **params)
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    return output.outputs


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7, n=3)], ids=["greedy", "sampled"])
def test_json_schema_outputs_parse_and_match_the_schema(llm, sampling):
    for completion in generate(llm, chat(llm, "Describe a person as JSON."), StructuredOutputsParams(json=PERSON),
                               **sampling):
        assert completion.finish_reason == "stop", completion.text
        person = json.loads(completion.text)
        assert set(person) == {"name", "age"} and isinstance(person["name"], str) and type(person["age"]) is int
        assert len(person["name"]) <= 20 and 0 <= person["age"] <= 120
        assert completion.token_ids[-1] in llm.engine.eos_token_ids  # ended by EOS, kept out of the text


def test_regex_choice_and_grammar_are_matched_whole(llm):
    sampled = dict(temperature=1.2, seed=11, n=4)
    for completion in generate(llm, chat(llm, "What is the phone number?"),
                               StructuredOutputsParams(regex=r"\d{3}-\d{4}"), **sampled):
        assert re.fullmatch(r"\d{3}-\d{4}", completion.text), completion.text
    # The mask beats even a +100 logit bias towards a token outside the choice.
    [maybe] = llm.tokenizer.encode("maybe")
    for completion in generate(llm, chat(llm, "Is Paris in France?"), StructuredOutputsParams(choice=["yes", "no"]),
                               logit_bias={maybe: 100.0}, **sampled):
        assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    grammar = 'root ::= "hello" (" " [a-z]+)?'
    for completion in generate(llm, chat(llm, "Say hi."), StructuredOutputsParams(grammar=grammar), **sampled):
        assert re.fullmatch(r"hello( [a-z]+)?", completion.text), completion.text


def test_any_json_object_keeps_every_token_in_the_grammar(llm):
    constraint = StructuredOutputsParams(json_object=True)
    [completion] = generate(llm, chat(llm, "Give me a JSON object about a cat."), constraint, temperature=0)
    assert completion.text.startswith("{")
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.runner.vocab_size, llm.engine.eos_token_ids)
    matcher = compiler.matcher(compiler.compile(constraint))
    assert all(matcher.accept_token(token) for token in completion.token_ids)
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)


def test_the_grammar_cache_is_bounded_and_keeps_the_most_recently_used(llm):
    """Each compiled grammar holds token masks (~1 MiB): a stream of distinct schemas must not
    grow the server without bound (issue #28)."""
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.runner.vocab_size, llm.engine.eos_token_ids,
                               max_cached_grammars=3)
    constraints = [StructuredOutputsParams(regex=f"a{{{length}}}") for length in range(1, 6)]
    first = compiler.compile(constraints[0])
    for constraint in constraints[1:3]:
        compiler.compile(constraint)
    assert compiler.compile(constraints[0]) is first  # a hit, and now the most recently used
    for constraint in constraints[3:]:
        compiler.compile(constraint)
    assert compiler.num_cached_grammars == 3
    assert compiler.compile(constraints[0]) is first


def test_the_grammar_ends_the_output_despite_min_tokens_and_ignore_eos(llm):
    prompt = chat(llm, "Is Paris in France?")
    for extra in (dict(min_tokens=5), dict(ignore_eos=True)):
        [completion] = generate(llm, prompt, StructuredOutputsParams(choice=["yes", "no"]), temperature=0, **extra)
        assert completion.text in ("yes", "no") and completion.finish_reason == "stop"


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(regex="(unclosed"), "structured_outputs regex is invalid"),
        (dict(grammar="root ::= missing_rule"), "structured_outputs grammar is invalid"),
        (dict(json="{not json"), "structured_outputs json is not valid JSON"),
    ],
)
def test_invalid_constraints_are_refused_before_queueing(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", "Hello", SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()


def test_constraint_fields_are_validated():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(use_beam_search=True, temperature=0, structured_outputs=StructuredOutputsParams(regex="a"))
