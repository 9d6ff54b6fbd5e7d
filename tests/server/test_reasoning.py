"""Reasoning parsers (--reasoning-parser): think blocks of chat replies go to reasoning_content,
whole and streamed, next to tool calls; chat_template_kwargs reach the chat template."""

import asyncio
import json

import httpx
import pytest
import torch

from pagedkv.outputs import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.openapi import ChatCompletion
from pagedkv.entrypoints.server.reasoning import ReasoningParser
from pagedkv.entrypoints.server.responses import ReplyOptions, ResponseBuilder
from pagedkv.entrypoints.server.tools import ToolCalling

CASES = {  # reply -> (reasoning, content) per parser
    "<think>Let me see.</think>It is 4.": {"qwen3": ("Let me see.", "It is 4."), "deepseek_r1": ("Let me see.", "It is 4.")},
    "Let me see.</think>It is 4.": {"qwen3": ("Let me see.", "It is 4."), "deepseek_r1": ("Let me see.", "It is 4.")},
    "It is 4.": {"qwen3": ("", "It is 4."), "deepseek_r1": ("It is 4.", "")},
    "<think>Cut off by max_tok": {"qwen3": ("Cut off by max_tok", ""), "deepseek_r1": ("Cut off by max_tok", "")},
    "<think></think>Quick.": {"qwen3": ("", "Quick."), "deepseek_r1": ("", "Quick.")},
}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("reply", list(CASES))
def test_streamed_parts_add_up_to_the_whole_split(name, reply):
    """Growing the reply one character at a time, what can be streamed only ever grows, never
    shows part of a tag, and ends as the finished reply's split."""
    parser = ReasoningParser(name)
    assert parser.split(reply) == CASES[reply][name]
    if name == "qwen3" and not reply.startswith("<think>") and "</think>" in reply:
        # A block opened in the prompt: qwen3 streams it as content, as it cannot know until the
        # close (templates that open the block belong to deepseek_r1).
        assert parser.split(reply[:5], finished=False) == ("", reply[:5])
        return
    previous = ("", "")
    for end in range(len(reply) + 1):
        reasoning, content = parser.split(reply[:end], finished=end == len(reply))
        assert reasoning.startswith(previous[0]) and content.startswith(previous[1]), (reply[:end], reasoning, content)
        assert "<" not in reasoning and "</think>" not in content
        previous = (reasoning, content)
    assert previous == CASES[reply][name]


HARMONY = "<|channel|>analysis<|message|>We need 2+2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
HARMONY_CASES = {  # GPT-OSS reply -> (reasoning, content)
    HARMONY: ("We need 2+2.", "It is 4."),
    "<|channel|>analysis<|message|>Cut off by max_tok": ("Cut off by max_tok", ""),
    "Not in harmony form.": ("", "Not in harmony form."),
    "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Done.": ("First.\nSecond.", "Checking.\nDone."),
    "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
    ' <|constrain|>json<|message|>{"city": "Oslo"}': (
        "Use the tool.", '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Oslo"}'),  # (a tool call stays content as written, for --tool-call-parser openai)
}


@pytest.mark.parametrize("reply", list(HARMONY_CASES))
def test_harmony_replies_split_whole_and_streamed(reply):
    """GPT-OSS (openai_gptoss): analysis messages are reasoning, final messages and preambles
    content; streamed parts only grow and show no marker outside a tool call."""
    parser = ReasoningParser("openai_gptoss")
    assert parser.keeps_special_tokens and not ReasoningParser("qwen3").keeps_special_tokens
    previous = ("", "")
    for end in range(len(reply) + 1):
        reasoning, content = parser.split(reply[:end], finished=end == len(reply))
        assert reasoning.startswith(previous[0]) and content.startswith(previous[1]), (reply[:end], reasoning, content)
        assert "<|" not in reasoning and ("<|" not in content or " to=" in reply)
        previous = (reasoning, content)
    assert previous == HARMONY_CASES[reply]


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        ReasoningParser("nope")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def streamed_chat_chunks(reply: str, cuts: list[int], reasoning_parser: str, tool_call_parser: str,
                         include_reasoning: bool = True) -> list[dict]:
    """The chat chunks the server streams for a reply that grows to each cut in turn (delta
    outputs: each what is new), with the get_weather tool offered ("auto")."""
    async def outputs():
        for step, cut in enumerate(cuts):
            last = cut == len(reply)
            completion = CompletionOutput(index=0, text=reply[cuts[step - 1] if step else 0:cut], token_ids=[step],
                                          finish_reason="stop" if last else None)
            yield 0, RequestOutput("r", "p", [1, 2], [completion], finished=last)

    async def collect():
        builder = ResponseBuilder(tokenizer=None, model_name="m", reasoning=ReasoningParser(reasoning_parser))
        tools = ToolCalling.from_request([WEATHER], "auto", tool_call_parser)
        return [json.loads(chunk[6:]) async for chunk in builder.stream_chunks(
            "r", outputs(), 1, 0, ReplyOptions(chat=True, tools=tools, include_reasoning=include_reasoning))
            if chunk.startswith("data: {")]

    return asyncio.run(collect())


def test_streamed_reasoning_then_content_then_a_tool_call():
    reply = ('<think>The user wants weather.</think>Checking. '
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    chunks = streamed_chat_chunks(reply, [3, 12, 30, 40, 52, 60, len(reply)], "qwen3", "hermes")
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks[1:]]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "The user wants weather."
    assert all(delta.get("reasoning") == delta.get("reasoning_content") for delta in deltas)
    assert "".join(delta.get("content", "") for delta in deltas) == "Checking. "
    [call] = deltas[-1]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_include_reasoning_false_leaves_the_reasoning_out():
    """vLLM's include_reasoning: false: the content and the call as before, no reasoning, whole or streamed."""
    reply = ('<think>The user wants weather.</think>Checking. '
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    deltas = [chunk["choices"][0]["delta"]
              for chunk in streamed_chat_chunks(reply, [3, 12, 30, 40, 52, 60, len(reply)], "qwen3", "hermes", False)[1:]]
    assert not any("reasoning" in delta or "reasoning_content" in delta for delta in deltas)
    assert "".join(delta.get("content", "") for delta in deltas) == "Checking. "
    assert deltas[-1]["tool_calls"]
    builder = ResponseBuilder(tokenizer=None, model_name="m", reasoning=ReasoningParser("qwen3"))
    completion = CompletionOutput(index=0, text="<think>Hm.</think>It is 4.", token_ids=[1], finish_reason="stop")
    output = RequestOutput("r", "p", [1, 2], [completion], finished=True)
    for include, reasoning in ((True, "Hm."), (False, None)):
        message = builder.full_response("r", [output], 0, ReplyOptions(chat=True, include_reasoning=include))[
            "choices"][0]["message"]
        assert (message["content"], message["reasoning_content"], message["reasoning"]) == ("It is 4.", reasoning, reasoning)


def test_streamed_harmony_reasoning_preamble_then_a_tool_call():
    """GPT-OSS: analysis streams as reasoning, a preamble as content, then the harmony tool
    message becomes a tool call (--reasoning-parser openai_gptoss, --tool-call-parser openai)."""
    reply = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary"
             "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
             '<|constrain|>json<|message|>{"city": "Oslo"}')
    chunks = streamed_chat_chunks(reply, list(range(0, len(reply), 7)) + [len(reply)], "openai_gptoss", "openai")
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks[1:]]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "The user wants weather."
    assert "".join(delta.get("content", "") for delta in deltas) == "Checking.\n"
    [call] = deltas[-1]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_server_splits_replies_whole_and_streamed():
    from support.live_server import LiveServer

    live = LiveServer(reasoning_parser="qwen3", gguf_weights="dequantized", num_device_blocks=64, max_model_len=256)
    try:
        # The grammar makes the model write a think block, whatever it would say (it starts at the
        # first token with thinking off: with it on, it would wait for the reply's </think>).
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
                "guided_regex": "<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>[A-Z][a-z]{2,10}",
                "chat_template_kwargs": {"enable_thinking": False}}
        whole = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
        ChatCompletion.model_validate(whole, strict=True)  # (its declared schema; the fuzzed server has no parser)
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
        assert "<" not in message["reasoning_content"] and message["content"][0].isupper()
        streamed = {"reasoning_content": "", "content": ""}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    for key in streamed:
                        streamed[key] += delta.get(key) or ""
        assert streamed == {"reasoning_content": message["reasoning_content"], "content": message["content"]}
    finally:
        live.stop()


def test_the_server_splits_harmony_replies():
    """--reasoning-parser openai_gptoss on the server, the harmony form forced by a grammar."""
    from support.live_server import LiveServer

    live = LiveServer(reasoning_parser="openai_gptoss", num_device_blocks=64, max_model_len=256)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120, "temperature": 0,
                "guided_regex": r"<\|channel\|>analysis<\|message\|>[a-z]{2,8}<\|end\|><\|start\|>assistant"
                                r"<\|channel\|>final<\|message\|>[A-Z][a-z]{2,10}"}
        message = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert message["reasoning_content"].isalpha() and message["reasoning_content"].islower()
        assert message["content"][0].isupper() and "<|" not in message["content"]
    finally:
        live.stop()


def test_chat_template_kwargs_reach_the_template():
    from support.live_server import LiveServer

    template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    live = LiveServer(chat_template=template, num_device_blocks=32, max_model_len=128)
    try:
        def tokens(**extra):
            body = {"messages": [{"role": "user", "content": "hello there"}], **extra}
            return httpx.post(live.url + "/tokenize", json=body, timeout=30).json()["tokens"]

        loud = tokens(chat_template_kwargs={"shout": True})
        assert live.engine.tokenizer.decode(loud).startswith("LOUD hello")
        assert not live.engine.tokenizer.decode(tokens()).startswith("LOUD")
    finally:
        live.stop()


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it():
    """Chat's reasoning_effort and Responses' reasoning.effort are template variables, with
    enable_thinking false for "none" unless chat_template_kwargs sets it (vLLM's)."""
    from support.live_server import LiveServer

    template = ("{% if reasoning_effort is defined %}EFFORT {{ reasoning_effort }} {% endif %}"
                "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                "{{ messages[-1]['content'] }}")
    live = LiveServer(chat_template=template, num_device_blocks=32, max_model_len=128)
    try:
        def prompt(route: str = "/v1/chat/completions", **extra) -> str:
            body = ({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1} if route.endswith("completions")
                    else {"input": "hello", "max_output_tokens": 1, "enable_response_messages": True})
            reply = httpx.post(live.url + route, json={**body, "return_token_ids": True, **extra}, timeout=60).json()
            ids = reply["prompt_token_ids"] if "prompt_token_ids" in reply else reply["input_messages"][0]["tokens"]
            return live.engine.tokenizer.decode(ids)

        assert prompt() == "hello"
        assert prompt(reasoning_effort="low") == "EFFORT low hello"
        assert prompt(reasoning_effort="none") == "EFFORT none NOTHINK hello"
        assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == "EFFORT none hello"
        assert httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello"}], "reasoning_effort": "huge"}).status_code == 400
        assert prompt("/v1/responses", reasoning={"effort": "high"}) == "EFFORT high hello"
        # vLLM's return_prompt_text: the rendered prompt in the reply, and in a stream's first chunk
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "reasoning_effort": "low",
                "return_prompt_text": True}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60).json()["prompt_text"] == (
            "EFFORT low hello")
        with httpx.stream("POST", live.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[0]["prompt_text"] == "EFFORT low hello" and all("prompt_text" not in c for c in chunks[1:])
    finally:
        live.stop()


def test_a_thinking_token_budget_closes_the_think_block():
    """vLLM's thinking_token_budget: after that many tokens in the think block the reply writes
    </think> and goes on as content; -1 is no limit; without a reasoning parser it is a 400."""
    from support.live_server import LiveServer

    template = "{{ messages[-1]['content'] }}<think>\n"  # (opened in the prompt, as deepseek_r1's templates do)
    live = LiveServer(chat_template=template, reasoning_parser="deepseek_r1", num_device_blocks=32,
                      max_model_len=128)
    try:
        tokenizer = live.engine.tokenizer
        end = tokenizer.encode("</think>", add_special_tokens=False)
        body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}

        def reply(**extra) -> dict:
            return httpx.post(live.url + "/v1/chat/completions", json={**body, **extra}, timeout=60).json()["choices"][0]

        free = reply()
        assert not free["message"]["content"] and "</think>" not in tokenizer.decode(free["token_ids"])
        assert reply(thinking_token_budget=-1)["token_ids"] == free["token_ids"]
        budgeted = reply(thinking_token_budget=3)
        ids = budgeted["token_ids"]
        assert ids[:3] == free["token_ids"][:3] and ids[3:3 + len(end)] == end
        assert budgeted["message"]["reasoning_content"] == tokenizer.decode(ids[:3])
        assert budgeted["message"]["content"] == tokenizer.decode(ids[3 + len(end):])
        assert httpx.post(live.url + "/v1/chat/completions", json={**body, "thinking_token_budget": -2},
                          timeout=60).status_code == 400
    finally:
        live.stop()
    plain = LiveServer(num_device_blocks=32, max_model_len=128)
    try:
        refused = httpx.post(plain.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 5})
        assert refused.status_code == 400 and "--reasoning-parser" in refused.text
    finally:
        plain.stop()


def test_the_budget_counts_a_block_the_reply_opens_and_ignores_closed_ones():
    from pagedkv.entrypoints.server.thinking_budget import budget_processor

    start, end = [7], [8, 9]
    force = budget_processor(2, start, end, lambda prompt: prompt[-1] == 7)

    def forced(prompt, output):
        logits = force(prompt, output, torch.zeros(12))
        return None if torch.isfinite(logits).all() else int(logits.argmax())

    assert forced([1, 2], [3, 7, 4]) is None  # one token in the block
    assert forced([1, 2], [3, 7, 4, 5]) == 8  # two: close it
    assert forced([1, 2], [3, 7, 4, 5, 8]) == 9  # the close's second token
    assert forced([1, 2], [3, 7, 4, 5, 8, 9]) is None  # closed: content
    assert forced([1, 2], [3, 4, 5]) is None  # no block
    assert forced([1, 7], [3, 4]) == 8  # opened in the prompt
    assert forced([1, 7, 8, 9], [3, 4]) is None  # not open at the prompt's end


@pytest.mark.parametrize("name, prompt_tail, thinking, ended", [
    ("deepseek_r1", "<|User|>Hi<|Assistant|><think>\n", True, False),  # opened by the template
    ("deepseek_r1", "<|User|>Hi<|Assistant|><think>\n\n</think>\n\n", True, True),  # an empty block written
    ("deepseek_r1", "<|User|>Hi<|Assistant|>", True, False),  # no tag: the reply reasons first (vLLM's)
    ("deepseek_r1", "<|User|>Hi<|Assistant|>", False, False),  # (deepseek_r1 does not read enable_thinking)
    ("qwen3", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", True, False),
    ("qwen3", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False, True),  # enable_thinking false
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", True, True),
    # a closed block in an earlier turn says nothing of this one
    ("qwen3", "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n<|im_start|>assistant\n", True, False),
    ("openai_gptoss", "<|start|>assistant", True, True),  # (GPT-OSS's grammar is never held back)
])
def test_whether_a_prompt_ends_the_reasoning_as_vllm_tells_it(name, prompt_tail, thinking, ended):
    assert ReasoningParser(name).prompt_ends_reasoning(prompt_tail, thinking) is ended


def test_a_matcher_after_a_marker_starts_once_the_marker_is_written():
    from pagedkv.params.structured_output import MatcherAfterMarker, grammar_applies

    class Recording:
        def __init__(self):
            self.accepted = []

        def accept_token(self, token_id):
            self.accepted.append(token_id)
            return token_id != 99

        def is_terminated(self):
            return self.accepted[-1:] == [5]

    inner = Recording()
    matcher = MatcherAfterMarker(inner, (8, 9))
    for token_id in (3, 8, 4, 9, 8):  # (8 then 4: not the marker)
        assert matcher.accept_token(token_id) and grammar_applies(matcher) is False
    assert matcher.accept_token(9) and grammar_applies(matcher) and inner.accepted == []
    assert matcher.accept_token(4) and not matcher.is_terminated() and inner.accepted == [4]
    assert matcher.accept_token(5) and matcher.is_terminated()
    assert not matcher.accept_token(99)
    assert grammar_applies(inner) and not grammar_applies(None)


def test_an_implicit_end_starts_the_grammar_and_is_masked_where_the_grammar_rejects_it():
    """qwen3's `<tool_call>` ends the reasoning without `</think>` and is the grammar's first token
    (vLLM's implicit reasoning end); one the grammar cannot start with is masked while reasoning."""
    import torch

    from pagedkv.params.structured_output import MatcherAfterMarker, grammar_applies, mask_disallowed_tokens

    class FirstTokenIsSix:
        def __init__(self):
            self.accepted = []

        def accept_token(self, token_id):
            self.accepted.append(token_id)
            return True

        def fill_next_token_bitmask(self, bitmask, row):  # (xgrammar's: bit set = allowed)
            bitmask[row] = 0
            bitmask[row, 0] = 1 << 6

    inner = FirstTokenIsSix()
    matcher = MatcherAfterMarker(inner, (8, 9), implicit=(6, 7))
    logits = torch.zeros(2, 40)
    mask_disallowed_tokens(logits, {1: matcher})
    assert torch.isinf(logits[1, 7]) and torch.isfinite(logits[1]).sum() == 39 and torch.isfinite(logits[0]).all()
    assert matcher.accept_token(3) and not grammar_applies(matcher) and inner.accepted == []
    assert matcher.accept_token(6) and grammar_applies(matcher) and inner.accepted == [6]
    logits = torch.zeros(1, 40)
    mask_disallowed_tokens(logits, {0: matcher})  # (now the grammar's own mask: only 6 allowed)
    assert torch.isfinite(logits[0]).sum() == 1 and torch.isfinite(logits[0, 6])


def test_structured_outputs_start_after_the_reasoning():
    """With a reasoning parser, vLLM's grammars (response_format, forced tool calls) start once the
    reply's reasoning has ended: the think block is free, the content constrained; a prompt that
    closes the block (here a template variable) constrains from the first token."""
    from support.live_server import LiveServer

    template = "{{ messages[-1]['content'] }}<think>\n{% if closed %}</think>\n{% endif %}"
    live = LiveServer(chat_template=template, reasoning_parser="deepseek_r1", num_device_blocks=48,
                      max_model_len=160)
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 8}}, "required": ["fruit"],
              "additionalProperties": False}
    json_format = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    try:
        tokenizer = live.engine.tokenizer
        end = tokenizer.encode("</think>", add_special_tokens=False)

        def reply(**extra) -> dict:
            answer = httpx.post(live.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]

        free = reply(max_tokens=8)["token_ids"]
        assert "</think>" not in tokenizer.decode(free)
        # the reply never closes its think block: the grammar never starts
        assert reply(max_tokens=8, response_format=json_format)["token_ids"] == free
        # (unless the reasoning is left out of the reply: then from the first token, as vLLM)
        hidden = reply(response_format=json_format, include_reasoning=False)["token_ids"]
        assert set(json.loads(tokenizer.decode(hidden, skip_special_tokens=True))) == {"fruit"}
        budgeted = reply(response_format=json_format, thinking_token_budget=3)
        ids = budgeted["token_ids"]
        assert ids[:3] == free[:3] and ids[3:3 + len(end)] == end
        assert budgeted["message"]["reasoning_content"] == tokenizer.decode(ids[:3])
        assert set(json.loads(budgeted["message"]["content"])) == {"fruit"}
        closed = reply(response_format=json_format, chat_template_kwargs={"closed": True})
        assert set(json.loads(tokenizer.decode(closed["token_ids"], skip_special_tokens=True))) == {"fruit"}
        city_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": False}}}
        named = reply(tools=[city_tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      thinking_token_budget=2)
        assert named["token_ids"][:2] == free[:2] and named["token_ids"][2:2 + len(end)] == end
        [call] = named["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    finally:
        live.stop()
    # vLLM's --structured-outputs-config.enable_in_reasoning: the grammar constrains the reasoning too
    live = LiveServer(chat_template=template, reasoning_parser="deepseek_r1", num_device_blocks=48,
                      max_model_len=160, app_options={"structured_outputs_in_reasoning": True})
    try:
        ids = reply(response_format=json_format)["token_ids"]
        assert set(json.loads(tokenizer.decode(ids, skip_special_tokens=True))) == {"fruit"}
    finally:
        live.stop()


class _Tokens:
    """A tokenizer for the counter: each marker one token, other text a token per character."""

    MARKERS = ["<think>", "</think>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|start|>"]

    def encode(self, text, add_special_tokens=False):
        ids = []
        while text:
            marker = next((m for m in self.MARKERS if text.startswith(m)), None)
            ids.append(1000 + self.MARKERS.index(marker) if marker else ord(text[0]))
            text = text[len(marker) if marker else 1:]
        return ids

    def decode(self, ids):
        return "".join(self.MARKERS[i - 1000] if i >= 1000 else chr(i) for i in ids)


@pytest.mark.parametrize("name, reply, reasoning", [
    ("deepseek_r1", "<think>abc</think>de", 3), ("deepseek_r1", "abc</think>de", 3), ("deepseek_r1", "abcd", 4),
    ("deepseek_r1", "<think>ab", 2), ("qwen3", "<think>abc</think>de", 3), ("qwen3", "abcd", 0),
    ("qwen3", "abc</think>de", 3), ("qwen3", "<think>ab", 2), ("qwen3", "<think></think>ok", 0),
    ("openai_gptoss", HARMONY, len("We need 2+2.")), ("openai_gptoss", "Not in harmony form.", 0),
    ("openai_gptoss", "<|channel|>analysis<|message|>Cut off", len("Cut off")),
])
def test_reasoning_tokens_are_the_tokens_of_the_split_reasoning(name, reply, reasoning):
    """vLLM's usage.completion_tokens_details.reasoning_tokens: a reply's tokens in the part the
    parser splits off as reasoning (markers left out), the same counted whole or as they stream."""
    from pagedkv.entrypoints.server.reasoning_tokens import ReasoningMarkers, ReasoningTokenCounter, count_reasoning_tokens

    parser, tokens = ReasoningParser(name), _Tokens()
    markers = ReasoningMarkers.of(tokens)
    ids = tokens.encode(reply)
    assert len(tokens.encode(parser.split(reply)[0])) == reasoning  # (the split's reasoning, as tokens)
    assert count_reasoning_tokens(parser, markers, ids) == reasoning
    streamed = ReasoningTokenCounter(parser, markers)
    for start in range(0, len(ids), 3):
        streamed.add(ids[start:start + 3])
    assert streamed.count == reasoning


def test_usage_counts_the_reasoning_tokens():
    """With a reasoning parser, chat usage carries completion_tokens_details.reasoning_tokens
    (whole, streamed, continuous) and Responses usage output_tokens_details.reasoning_tokens;
    without one, chat usage has no details."""
    from support.live_server import LiveServer

    template = "{{ messages[-1]['content'] }}<think>\n"
    live = LiveServer(chat_template=template, reasoning_parser="deepseek_r1", num_device_blocks=48,
                      max_model_len=160)
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "thinking_token_budget": 4}
    try:
        end = live.engine.tokenizer.encode("</think>", add_special_tokens=False)
        whole = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
        ChatCompletion.model_validate(whole, strict=True)
        assert whole["usage"]["completion_tokens"] == 12
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}  # (the marker's tokens not)
        stream_options = {"include_usage": True, "continuous_usage_stats": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": stream_options}) as reply:
            usages = [json.loads(line[6:]).get("usage") for line in reply.iter_lines() if line.startswith("data: {")]
        counted = [usage["completion_tokens_details"]["reasoning_tokens"] for usage in usages
                   if usage and "completion_tokens_details" in usage]
        assert counted == sorted(counted) and counted[-1] == 4 and usages[-1]["completion_tokens_details"] == {
            "reasoning_tokens": 4}
        response = httpx.post(live.url + "/v1/responses", timeout=60, json={
            "input": "Why is the sky blue?", "max_output_tokens": 4 + len(end) + 2, "temperature": 0}).json()
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": response["usage"]["output_tokens"]}
    finally:
        live.stop()
    plain = LiveServer(num_device_blocks=32, max_model_len=128)
    try:
        usage = httpx.post(plain.url + "/v1/chat/completions", timeout=60, json={**body, "thinking_token_budget": None}
                           ).json()["usage"]
        assert "completion_tokens_details" not in usage
    finally:
        plain.stop()
