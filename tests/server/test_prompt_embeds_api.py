"""The completions API's `prompt_embeds` (vLLM's, with --enable-prompt-embeds): base64 of a
torch.save'd tensor, alone, batched, streamed, beside text prompts (embeddings first), with
logprobs; clear 400s for what is not a tensor or cannot take embeddings."""

import argparse
import base64
import io

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI

from pagedkv.entrypoints.cli import add_engine_arguments, engine_config


def encoded(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def live():
    from support.live_server import LiveServer

    server = LiveServer(enable_prompt_embeds=True, num_device_blocks=128, max_model_len=512,
                        app_options={"trust_request_chat_template": True})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def texts_and_embeds(live):
    """Two prompts as token ids and as the model's own embeddings of those tokens."""
    engine = live.engine
    table = engine.runner.model.embed_tokens.weight.detach()
    texts = ["Hello, my name is", "What is an LLM?"]
    ids = [engine.tokenizer.encode(text) for text in texts]
    return texts, [encoded(table[token_ids].clone()) for token_ids in ids]


def complete(client, **options):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, max_tokens=5, temperature=0.0, **options)


def test_embeddings_complete_as_their_tokens_do_alone_batched_and_streamed(client, texts_and_embeds):
    texts, embeds = texts_and_embeds
    by_text = [complete(client, prompt=text).choices[0].text for text in texts]
    one = complete(client, prompt="", extra_body={"prompt_embeds": embeds[0]})
    assert [choice.text for choice in one.choices] == by_text[:1]
    assert one.usage.prompt_tokens == complete(client, prompt=texts[0]).usage.prompt_tokens  # (counted from its rows)
    both = complete(client, prompt="", extra_body={"prompt_embeds": embeds})
    assert [choice.text for choice in sorted(both.choices, key=lambda c: c.index)] == by_text
    stream = complete(client, prompt="", stream=True, extra_body={"prompt_embeds": embeds})
    pieces, finishes = ["", ""], 0
    for chunk in stream:
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
            finishes += choice.finish_reason is not None
    assert pieces == by_text and finishes == 2
    mixed = complete(client, prompt=texts[1], extra_body={"prompt_embeds": embeds[0]})
    assert [choice.text for choice in sorted(mixed.choices, key=lambda c: c.index)] == [by_text[0], by_text[1]]
    only_text = complete(client, prompt=texts[1], extra_body={"prompt_embeds": []})
    assert [choice.text for choice in only_text.choices] == by_text[1:]


@pytest.mark.parametrize("logprobs", [0, 2])
def test_logprobs_of_embedded_prompts(client, texts_and_embeds, logprobs):
    texts, embeds = texts_and_embeds
    reference = complete(client, prompt=texts[0], logprobs=logprobs).choices[0].logprobs
    got = complete(client, prompt="", logprobs=logprobs, extra_body={"prompt_embeds": embeds[0]}).choices[0].logprobs
    assert got.tokens == reference.tokens and len(got.top_logprobs) == 5
    assert got.token_logprobs == pytest.approx(reference.token_logprobs, abs=1e-4)
    assert all(max(logprobs, 1) <= len(top) <= logprobs + 1 for top in got.top_logprobs)


def test_what_is_not_a_tensor_or_cannot_take_one_is_a_400(client, live, texts_and_embeds):
    _, embeds = texts_and_embeds
    bad = {
        "invalid_base64": "base64",
        base64.b64encode(b"not a torch file").decode(): "torch.save",
        encoded({"a": torch.zeros(2)}): "not one tensor",  # (weights_only allows dicts of tensors)
        encoded(torch.zeros(3, 7)): "hidden_size",
    }
    for value, message in bad.items():
        with pytest.raises(BadRequestError, match=message):
            complete(client, prompt="", extra_body={"prompt_embeds": value})
    for prompt_logprobs in (1, True):  # (vLLM reads true as 1, as its tests send it)
        with pytest.raises(BadRequestError, match="not compatible"):
            complete(client, prompt="", extra_body={"prompt_embeds": embeds[0], "prompt_logprobs": prompt_logprobs})
    answer = httpx.post(live.url + "/v1/completions", json={"max_tokens": 2}, timeout=30)
    assert answer.status_code == 400 and "prompt" in answer.text


def test_the_flag_turns_them_on():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config(parser.parse_args(["--enable-prompt-embeds"])).enable_prompt_embeds
    assert not engine_config(parser.parse_args([])).enable_prompt_embeds


def chat(client, messages, **options):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0, **options)


def test_chat_messages_take_prompt_embeds_parts(client, live):
    """A message's {"type": "prompt_embeds", "data": ...} parts stand where their embeddings go."""
    engine = live.engine
    table = engine.runner.model.embed_tokens.weight.detach()
    content = "Hello, my name is"
    part = {"type": "prompt_embeds", "data": encoded(table[engine.tokenizer.encode(content, add_special_tokens=False)])}
    by_text = chat(client, [{"role": "user", "content": content}]).choices[0].message.content
    assert chat(client, [{"role": "user", "content": [part]}]).choices[0].message.content == by_text
    mixed = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}, part]},
             {"role": "user", "content": [part, {"type": "text", "text": " What is it?"}]}]
    whole = chat(client, mixed).choices[0].message.content
    assert whole
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(client, mixed, stream=True)
                       if chunk.choices)
    assert streamed == whole


def test_bad_prompt_embeds_parts_are_400s(client):
    for part in ({"type": "prompt_embeds"}, {"type": "prompt_embeds", "data": "not_valid_base64!!"},
                 {"type": "prompt_embeds", "data": encoded(torch.zeros(2, 3, 4, 5))}):
        with pytest.raises(BadRequestError):
            chat(client, [{"role": "user", "content": [part]}])


REASONING_TEMPLATE = (  # (vLLM's test template: an assistant turn's reasoning in think tags)
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m.get('reasoning') %}{{ '<think>' + m['reasoning'] + '</think>' }}{% endif %}"
    "{{ m['content'] }}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_an_assistant_turns_reasoning_may_be_embeddings_and_a_request_its_own_template(client, live):
    """vLLM's: `reasoning` as a prompt_embeds part stands where the template puts the reasoning
    (here with the request's own chat_template, which --trust-request-chat-template allows)."""
    engine = live.engine
    table = engine.runner.model.embed_tokens.weight.detach()
    thought = "The user greets me."
    as_embeds = {"type": "prompt_embeds", "data": encoded(table[engine.tokenizer.encode(thought, add_special_tokens=False)])}

    def reply(reasoning):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning": reasoning, "content": "Hello!"},
                    {"role": "user", "content": "How are you?"}]
        return chat(client, messages, extra_body={"chat_template": REASONING_TEMPLATE})

    by_text, by_embeds = reply(thought), reply(as_embeds)
    assert by_embeds.choices[0].message.content == by_text.choices[0].message.content
    assert by_embeds.usage.prompt_tokens == by_text.usage.prompt_tokens
    rendered = httpx.post(live.url + "/tokenize", timeout=30, json={
        "messages": [{"role": "assistant", "reasoning": thought, "content": "Hello!"}], "add_generation_prompt": False,
        "chat_template": REASONING_TEMPLATE}).json()["tokens"]
    assert engine.tokenizer.decode(rendered) == f"<|im_start|>assistant\n<think>{thought}</think>Hello!<|im_end|>\n"
    for bad in ({"type": "prompt_embeds"}, {"type": "prompt_embeds", "data": "not_valid_base64!!"},
                {"type": "prompt_embeds", "data": ""}):
        with pytest.raises(BadRequestError):
            reply(bad)


def test_a_requests_own_template_needs_the_servers_trust():
    from support.live_server import LiveServer

    server = LiveServer(num_device_blocks=32, max_model_len=128)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "chat_template": REASONING_TEMPLATE}
        for route, extra in (("/v1/chat/completions", {}), ("/tokenize", {})):
            refused = httpx.post(server.url + route, json={**body, **extra}, timeout=30)
            assert refused.status_code == 400 and "--trust-request-chat-template" in refused.json()["error"]["message"]
        kwargs = {"messages": body["messages"], "max_tokens": 2, "chat_template_kwargs": {"chat_template": "x"}}
        assert httpx.post(server.url + "/v1/chat/completions", json=kwargs, timeout=30).status_code == 400
    finally:
        server.stop()
