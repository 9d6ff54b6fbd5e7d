"""OpenAI's Responses API (/v1/responses) through the openai client: the same reply as chat
completions, streamed events that add up to the whole response, function tools, reasoning items,
structured text formats, stored responses read back and continued, background responses polled
and cancelled, and clear 400s for what the server cannot do."""

import json
import time

import httpx
import pytest
from openai import OpenAI

from pagedkv.entrypoints.server.openapi import ResponseBody
from pagedkv.entrypoints.server.reasoning import ReasoningParser
from pagedkv.entrypoints.server.responses_api import ResponseState
from pagedkv.entrypoints.server.protocol import ResponsesRequest
from pagedkv.entrypoints.server.tools import ToolCalling

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def live():
    from support.live_server import LiveServer

    server = LiveServer(reasoning_parser="qwen3", gguf_weights="dequantized", num_device_blocks=128, max_model_len=512)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_a_response_carries_the_chat_completions_reply(client, live):
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=12, temperature=0)
    response = client.responses.create(model=model, instructions="Be brief.", input="Name a fruit.",
                                       max_output_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_response_messages_carry_the_prompt_and_reply_as_text_and_token_ids(client, live):
    """vLLM's enable_response_messages: the prompt the model saw and its reply, as raw text and
    token ids (whole, streamed and background alike); absent unless asked for."""
    model = client.models.list().data[0].id
    request = dict(model=model, input="Hello?", max_output_tokens=8, temperature=0)
    plain = client.responses.create(**request)
    assert "input_messages" not in plain.model_extra
    whole = client.responses.create(**request, extra_body={"enable_response_messages": True})
    [prompt], [reply] = whole.input_messages, whole.output_messages
    tokenizer = live.engine.tokenizer
    assert prompt["type"] == reply["type"] == "raw_message_tokens"
    assert "Hello?" in prompt["message"] and tokenizer.encode(prompt["message"], add_special_tokens=False) == \
        prompt["tokens"]
    assert reply["message"] == whole.output_text == plain.output_text
    assert len(reply["tokens"]) == whole.usage.output_tokens and tokenizer.decode(reply["tokens"]) == reply["message"]
    events = list(client.responses.create(**request, stream=True, extra_body={"enable_response_messages": True}))
    final = events[-1].response
    assert (final.input_messages, final.output_messages) == (whole.input_messages, whole.output_messages)


def test_streamed_events_add_up_to_the_whole_response(client):
    model = client.models.list().data[0].id
    request = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Count to five."}]}],
                   max_output_tokens=16, temperature=0)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == whole.output_text
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert done.text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens > 1  # (counted over every step)


def test_logprobs_come_with_the_text_when_included_as_chat_completions_give_them(client):
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    expected = [(entry.token, entry.logprob, [top.token for top in entry.top_logprobs])
                for entry in chat.choices[0].logprobs.content]
    request = dict(model=model, input="Name a fruit.", max_output_tokens=8, temperature=0, top_logprobs=3)
    response = client.responses.create(**request, include=["message.output_text.logprobs"])
    [message] = response.output
    got = [(entry.token, entry.logprob, [top.token for top in entry.top_logprobs]) for entry in message.content[0].logprobs]
    # (the same tokens and candidates; logprobs to float32 noise: the second request reads the first's
    # cached prefix, a differently batched prefill)
    def same(a, b):
        return [(t, c) for t, _, c in a] == [(t, c) for t, _, c in b] and all(
            x == pytest.approx(y, abs=1e-4) for (_, x, _), (_, y, _) in zip(a, b))
    assert same(got, expected) and len(got) == response.usage.output_tokens and response.top_logprobs == 3
    events = list(client.responses.create(**request, include=["message.output_text.logprobs"], stream=True))
    streamed = [(entry.token, entry.logprob, [top.token for top in entry.top_logprobs])
                for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    assert same(streamed, expected)
    assert client.responses.create(**request).output[0].content[0].logprobs == []  # (not included: none)


def test_reasoning_items_come_before_the_message(client):
    model = client.models.list().data[0].id
    # (the grammar writes the think block: with thinking off it starts at the first token; with
    # it on, with the qwen3 parser, it would wait for the reply's </think>, as vLLM's does)
    extra = {"guided_regex": "<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>[A-Z][a-z]{2,10}"}
    raw = client.responses.with_raw_response.create(model=model, input="Hi", max_output_tokens=40, temperature=0,
                                                    extra_body=extra, reasoning={"effort": "none"})
    ResponseBody.model_validate(raw.http_response.json(), strict=True)  # (the fuzzed server has no reasoning items)
    response = raw.parse()
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text and "<" not in reasoning.content[0].text
    assert message.type == "message" and response.output_text[0].isupper()
    events = list(client.responses.create(model=model, input="Hi", max_output_tokens=40, temperature=0,
                                          extra_body=extra, reasoning={"effort": "none"}, stream=True))
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text


def test_function_tools_and_their_results(client):
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                       temperature=0, reasoning={"effort": "none"})  # (thinking off: see above)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) >= {"city"}
    # The call and its output go back in as input items.
    follow_up = client.responses.create(
        model=model, tools=[WEATHER], max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert follow_up.status in ("completed", "incomplete") and follow_up.output[0].type in ("message", "function_call")


AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.",
     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
    {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}]}


def test_namespaced_tools_reach_the_model_flat_and_their_calls_come_back_split(client):
    """vLLM's `namespace` tools (Codex-style clients): the model sees `multi_agent_v1__spawn_agent`;
    the call comes back as name `spawn_agent` in namespace `multi_agent_v1`, and goes back in so."""
    model = client.models.list().data[0].id
    request = dict(model=model, input="Start an agent that says hi.", tools=[AGENTS, WEATHER], max_output_tokens=40,
                   temperature=0, tool_choice={"type": "function", "name": "spawn_agent"},  # (its own name: one namespace has it)
                   reasoning={"effort": "none"})  # (thinking off: the forced call starts at once)
    response = client.responses.create(**request)
    [call] = response.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert set(json.loads(call.arguments)) == {"message"}
    events = list(client.responses.create(**request, stream=True))
    items = [event.item for event in events if event.type in ("response.output_item.added", "response.output_item.done")]
    assert [(item.name, item.namespace) for item in items] == [("spawn_agent", "multi_agent_v1")] * 2
    assert items[1].arguments == call.arguments
    named_flat = client.responses.create(**dict(request, tool_choice={"type": "function", "name": "get_weather"}))
    assert named_flat.output[0].name == "get_weather" and getattr(named_flat.output[0], "namespace", None) is None
    follow_up = client.responses.create(
        model=model, tools=[AGENTS], max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Start an agent that says hi."},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "namespace": call.namespace,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7 started"}])
    assert follow_up.status in ("completed", "incomplete")


def test_namespaced_tool_names_are_flattened_and_split_without_a_server():
    request = ResponsesRequest(input=[
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}"}],
        tools=[AGENTS, dict(WEATHER, name="plain__tool")], tool_choice={"type": "function", "name": "wait_agent"})
    tools, choice = request.chat_tools()
    assert [tool["function"]["name"] for tool in tools] == [
        "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent", "plain__tool"]
    assert tools[0]["function"]["description"] == "Spawn a sub-agent."
    assert choice == {"type": "function", "function": {"name": "multi_agent_v1__wait_agent"}}
    assert request.input_messages()[1].tool_calls[0].function.name == "multi_agent_v1__spawn_agent"
    assert request.split_tool_name("multi_agent_v1__wait_agent") == ("multi_agent_v1", "wait_agent")
    assert request.split_tool_name("plain__tool") == (None, "plain__tool")  # (a plain tool's own name)
    assert request.split_tool_name("multi_agent_v1__unknown") == (None, "multi_agent_v1__unknown")
    state = ResponseState("m", request, None, ToolCalling.from_request(tools, "auto"))
    body = state.complete('<tool_call>{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "hi"}}</tool_call>',
                          "stop", None)
    [item] = state.items
    assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert state.reply_messages()[0].tool_calls[0].function.name == "multi_agent_v1__spawn_agent"
    ResponseBody.model_validate(body)  # (as /openapi.json declares it)


def test_text_format_json_schema_constrains_the_reply(client):
    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}}, "required": ["fruit"],
              "additionalProperties": False}
    # (reasoning effort "none": thinking off, so with the qwen3 parser the grammar starts at once)
    response = client.responses.create(model=model, input="Name a fruit as JSON.", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "fruit", "schema": schema}},
                                       reasoning={"effort": "none"})
    assert set(json.loads(response.output_text)) == {"fruit"}
    # thinking on (the default): the grammar waits for the reply's </think>, which this model never writes
    thinking = client.responses.create(model=model, input="Name a fruit as JSON.", max_output_tokens=6, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "fruit", "schema": schema}})
    free = client.responses.create(model=model, input="Name a fruit as JSON.", max_output_tokens=6, temperature=0)
    assert thinking.output_text == free.output_text


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "background": True, "store": False}, "background"),
    ({"input": "Hi", "background": True, "stream": True}, "background"),
    ({"input": [{"type": "image_generation_call"}]}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_the_server_cannot_do_is_a_400_naming_the_field(live, body, param):
    response = httpx.post(live.url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_streamed_function_calls_follow_the_text_before_them():
    """Without a server: a reply that writes text, then a Hermes tool call, streamed in pieces."""
    request = ResponsesRequest(input="weather?", tools=[WEATHER])
    chat_tools, choice = request.chat_tools()
    state = ResponseState("m", request, ReasoningParser("qwen3"), ToolCalling.from_request(chat_tools, choice))
    reply = '<think>Need a tool.</think>Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events = state.start()
    for cut in (5, 20, 33, 50, len(reply)):
        events += state.update(reply[:cut], "stop" if cut == len(reply) else None, cut == len(reply))
    events += state.finish("stop", {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2})
    payloads = [json.loads(event.split("data: ", 1)[1]) for event in events]
    assert "".join(p["delta"] for p in payloads if p["type"] == "response.reasoning_text.delta") == "Need a tool."
    assert "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta") == "Checking. "
    final = payloads[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert json.loads(final["output"][2]["arguments"]) == {"city": "Oslo"}
    call = [p for p in payloads if p["type"].startswith("response.function_call") or
            (p["type"].startswith("response.output_item") and p["item"]["type"] == "function_call")]
    assert [p["type"] for p in call] == ["response.output_item.added", "response.function_call_arguments.delta",
                                         "response.function_call_arguments.done", "response.output_item.done"]
    assert call[0]["item"]["arguments"] == "" and call[1]["delta"] == final["output"][2]["arguments"]


def test_a_stored_response_is_read_back_and_continued(client, live):
    """store (the default): GET /v1/responses/{id} gives the response as answered (streamed ones
    too), and previous_response_id puts its conversation, input and output, before the new input:
    the prompt is exactly the one of the whole conversation sent at once (its instructions are not
    carried over)."""
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, instructions="Be brief.", input="My name is Ada.", max_output_tokens=8,
                                    temperature=0)
    assert first.store and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    whole = client.responses.create(model=model, max_output_tokens=8, temperature=0, store=False, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == whole.usage.input_tokens and second.output_text == whole.output_text
    assert httpx.get(live.url + f"/v1/responses/{whole.id}", timeout=10).status_code == 404  # (store=False)

    events = list(client.responses.create(model=model, input="Count: one, two,", max_output_tokens=6, temperature=0,
                                          stream=True))
    streamed = events[-1].response  # (response.incomplete here: cut by max_output_tokens)
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    for response in (httpx.get(live.url + "/v1/responses/resp_unknown", timeout=10),
                     httpx.post(live.url + "/v1/responses", timeout=30,
                                json={"input": "Hi", "previous_response_id": "resp_unknown"})):
        assert response.status_code == 404 and "resp_unknown" in response.json()["error"]["message"]


def test_a_background_response_is_polled_to_its_end_and_another_is_cancelled(client, live):
    """background: answered at once ("queued"), then GET /v1/responses/{id} shows it made, with the
    reply a foreground request gets; POST .../cancel stops one still being made (its engine request
    aborted, its blocks freed) and leaves it "cancelled"; ended, foreground and unknown responses
    cannot be cancelled."""
    model = client.models.list().data[0].id
    options = dict(model=model, input="Count: one, two,", max_output_tokens=8, temperature=0)
    queued = client.responses.create(**options, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never ended"
        time.sleep(0.05)
    foreground = client.responses.create(**options, store=False)
    assert polled.status == foreground.status and polled.output_text == foreground.output_text
    assert polled.usage.output_tokens == foreground.usage.output_tokens

    running = client.responses.create(model=model, input="Tell a long story.", max_output_tokens=400, temperature=0,
                                      background=True)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    for response_id, status in ((running.id, 400), (queued.id, 400), (foreground.id, 404), ("resp_unknown", 404)):
        answer = httpx.post(live.url + f"/v1/responses/{response_id}/cancel", timeout=10)
        assert answer.status_code == status, (response_id, answer.text)
    stored_foreground = client.responses.create(**options)
    refused = httpx.post(live.url + f"/v1/responses/{stored_foreground.id}/cancel", timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "Cannot cancel a synchronous response."
    deadline = time.monotonic() + 30
    while live.metric("pagedkv_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.metric("pagedkv_requests_running") == 0, "the cancelled response's request was aborted"
