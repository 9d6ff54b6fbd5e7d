"""OpenAI-shaped response bodies and SSE chunks built from engine outputs."""

from __future__ import annotations

import json
from typing import AsyncIterator

from pagedkv.outputs import RequestOutput


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ResponseBuilder:
    """Completions and chat completions, whole or streamed, for one served model. Choice
    `i * n + j` is sample `j` of prompt `i`; `echo` prepends each prompt to its choices."""

    def __init__(self, tokenizer, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name

    async def stream_chunks(
        self, request_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int, created: int,
        chat: bool, include_usage: bool, n: int, echo: bool,
    ) -> AsyncIterator[str]:
        """SSE chunks of (prompt index, output) pairs as they arrive, then usage and [DONE]."""
        num_choices = n * num_prompts
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(num_choices)]
            yield sse({"id": request_id, "object": kind, "created": created, "model": self.model_name, "choices": first})
        async for prompt_index, output in outputs:
            choices = []
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                text = completion.text
                delta = text[sent_text.get(index, 0):]
                if echo and index not in sent_text:
                    delta = self.prompt_text(output) + delta
                if not delta and completion.finish_reason is None:
                    continue
                first_token = sent_tokens.get(index, 0)
                sent_text[index], sent_tokens[index] = len(text), len(completion.token_ids)
                if chat:
                    choices.append({"index": index, "delta": {"content": delta} if delta else {},
                                    "logprobs": self.chat_logprobs(completion, first_token),
                                    "finish_reason": completion.finish_reason})
                else:
                    offset = len(self.prompt_text(output)) if echo else 0
                    choices.append({"index": index, "text": delta,
                                    "logprobs": self.completion_logprobs(completion, first_token, offset),
                                    "finish_reason": completion.finish_reason})
            if choices:
                yield sse({"id": request_id, "object": kind, "created": created, "model": self.model_name, "choices": choices})
            if output.finished:
                finals[prompt_index] = output
                if len(finals) == num_prompts:
                    if include_usage:
                        yield sse({"id": request_id, "object": kind, "created": created, "model": self.model_name,
                                   "choices": [], "usage": self.usage(list(finals.values()))})
                    yield "data: [DONE]\n\n"
                    return

    def prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def full_response(self, request_id: str, outputs: list, created: int, chat: bool, n: int, echo: bool) -> dict:
        choices = []
        for prompt_index, output in enumerate(outputs):
            prefix = self.prompt_text(output) if echo else ""
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                if chat:
                    choice = {"index": index, "message": {"role": "assistant", "content": completion.text},
                              "finish_reason": completion.finish_reason, "logprobs": self.chat_logprobs(completion)}
                else:
                    choice = {"index": index, "text": prefix + completion.text,
                              "finish_reason": completion.finish_reason, "logprobs": self.completion_logprobs(completion)}
                choices.append(choice)
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": self.usage(outputs)}

    def completion_logprobs(self, completion, first_token: int = 0, text_offset: int = 0):
        """OpenAI completion logprobs of tokens first_token.. of a completion whose text starts at text_offset."""
        if completion.logprobs is None:
            return None
        tokenizer = self.tokenizer
        token_ids = completion.token_ids[first_token:]
        entries = completion.logprobs[first_token:]
        tokens = [tokenizer.decode([t]) for t in token_ids]
        start = text_offset + sum(len(tokenizer.decode([t])) for t in completion.token_ids[:first_token])
        offsets = []
        for token in tokens:
            offsets.append(start)
            start += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.get(t) for entry, t in zip(entries, token_ids)],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in entry.items()} for entry in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, completion, first_token: int = 0):
        if completion.logprobs is None:
            return None
        decode = self.tokenizer.decode
        content = []
        for entry, token in zip(completion.logprobs[first_token:], completion.token_ids[first_token:]):
            content.append({
                "token": decode([token]),
                "logprob": entry.get(token),
                "top_logprobs": [{"token": decode([t]), "logprob": lp} for t, lp in entry.items() if t != token],
            })
        return {"content": content}

    def usage(self, outputs: list) -> dict:
        completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

