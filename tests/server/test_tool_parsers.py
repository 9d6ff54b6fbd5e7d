"""Tool-call parsers for tool_choice "auto" (--tool-call-parser hermes | llama3_json | mistral):
calls found in whole replies, streamed text held back where a call may begin, unknown tools and
broken JSON left as content; a server with the mistral parser end to end."""

import json

import httpx
import pytest

from pagedkv.entrypoints.server.tools import ToolCalling

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

REPLIES = {  # parser -> (reply with two calls and some text, the text that is content)
    "hermes": ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Checking."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "mistral": ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', "Checking."),
}


@pytest.mark.parametrize("parser", list(REPLIES))
def test_each_parser_finds_both_calls_and_the_content(parser):
    tools = ToolCalling.from_request([WEATHER, TIME], "auto", parser)
    reply, content = REPLIES[parser]
    parsed_content, calls, reason = tools.parse(reply, "stop")
    assert parsed_content == content and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    # Streamed: nothing of a call goes out as content, at any point of the reply.
    for end in range(len(reply)):
        assert reply[: tools.streamable_len(reply[:end])] in (content or "") + " "


def test_mistral_name_and_args_form():
    tools = ToolCalling.from_request([WEATHER, TIME], "auto", "mistral")
    content, calls, _ = tools.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}', "stop")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("parser,reply", [
    ("hermes", "Just text."),
    ("llama3_json", "Sure, it is sunny."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Os'),  # cut off by max_tokens
    ("mistral", '[TOOL_CALLS][{"name": "unknown_tool", "arguments": {}}]'),
])
def test_replies_without_valid_calls_stay_content(parser, reply):
    tools = ToolCalling.from_request([WEATHER], "auto", parser)
    assert tools.parse(reply, "length") == (reply, [], "length")


def test_plain_llama3_replies_stream_as_they_come():
    tools = ToolCalling.from_request([WEATHER], "auto", "llama3_json")
    assert tools.streamable_len("Sure, it is") == len("Sure, it is")
    assert tools.streamable_len('{"name": "get_') == 0 and tools.streamable_len("<|python") == 0


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="tool-call parser must be one of"):
        ToolCalling.from_request([WEATHER], "auto", "pythonic")


def test_a_server_with_the_mistral_parser_returns_tool_calls():
    from support.live_server import LiveServer

    # The grammar makes the model write a Mistral-style call, whatever it would say.
    regex = r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\]'
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER], "max_tokens": 60,
            "temperature": 0, "guided_regex": regex}
    choices = {}
    for parser in ("hermes", "mistral"):
        live = LiveServer(num_device_blocks=64, max_model_len=256, tool_call_parser=parser)
        try:
            choices[parser] = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        finally:
            live.stop()
    assert choices["hermes"]["finish_reason"] != "tool_calls"  # the default parser does not read this format
    assert choices["mistral"]["finish_reason"] == "tool_calls"
    [call] = choices["mistral"]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]


def test_parallel_tool_calls_false_returns_the_first_call_only():
    """vLLM's parallel_tool_calls: false keeps a reply's first call, whole and streamed, in chat and
    Responses; by default every call is returned."""
    from support.live_server import LiveServer

    reply = REPLIES["hermes"][0]
    regex = "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in reply)  # the reply, literally
    chat = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, TIME],
            "max_tokens": 200, "temperature": 0, "guided_regex": regex}  # (the grammar's text: ~100 tokens)
    live = LiveServer(num_device_blocks=64, max_model_len=512)
    try:
        def names(**extra) -> list[str]:
            body = {**chat, **extra}
            if not body.get("stream"):
                message = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
                return [call["function"]["name"] for call in message["message"]["tool_calls"]]
            found = []
            with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            found += [call["function"]["name"] for call in choice["delta"].get("tool_calls") or []]
            return found

        assert names() == ["get_weather", "get_time"]
        assert names(parallel_tool_calls=False) == ["get_weather"]
        assert names(parallel_tool_calls=False, stream=True) == ["get_weather"]
        assert names(stream=True) == ["get_weather", "get_time"]
        responses = {"input": "Weather in Oslo?", "tools": [{"type": "function", **WEATHER["function"]},
                                                            {"type": "function", **TIME["function"]}],
                     "max_output_tokens": 200, "temperature": 0, "guided_regex": regex}
        for parallel, want in ((True, 2), (False, 1)):
            body = httpx.post(live.url + "/v1/responses", json={**responses, "parallel_tool_calls": parallel},
                              timeout=120).json()
            assert [item["type"] for item in body["output"]].count("function_call") == want, body["output"]
            assert body["parallel_tool_calls"] is parallel
    finally:
        live.stop()
