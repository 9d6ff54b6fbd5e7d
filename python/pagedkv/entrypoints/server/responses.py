"""OpenAI-shaped response bodies and SSE chunks built from engine outputs."""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
import time
import uuid
from typing import AsyncIterator, Optional

from pagedkv.outputs import ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, RequestOutput
from pagedkv.entrypoints.server.reasoning import ReasoningParser
from pagedkv.entrypoints.server.reasoning_tokens import ReasoningMarkers, ReasoningTokenCounter, count_reasoning_tokens
from pagedkv.entrypoints.server.request_timing import timing_metrics
from pagedkv.entrypoints.server.tools import ToolCalling


@dataclasses.dataclass(frozen=True)
class ReplyOptions:
    """What one request asks of its reply's shape."""

    chat: bool
    n: int = 1  # samples per prompt: choice i * n + j is sample j of prompt i
    echo: bool = False  # prompts before their choices (completions)
    # chat with echo: per conversation, its last assistant message's text, before each reply's
    chat_echoes: tuple[str, ...] = ()
    include_usage: bool = False  # a streamed usage chunk at the end
    continuous_usage: bool = False  # usage so far in every streamed chunk (stream_options.continuous_usage_stats)
    tools: Optional[ToolCalling] = None
    top_logprobs: int = 0  # chat: candidates per token
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's token ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs: candidates per prompt token, in the reply
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning parser's part out of the reply
    prompt_text: bool = False  # vLLM's return_prompt_text: chat's rendered prompt in the reply


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ResponseBuilder:
    """Completions and chat completions, whole or streamed, for one served model. Choice
    `i * n + j` is sample `j` of prompt `i`; `echo` prepends each prompt to its choices; a
    `reasoning` parser moves chat replies' think blocks to `reasoning_content`;
    `prompt_tokens_details` adds `usage.prompt_tokens_details.cached_tokens` (vLLM's
    --enable-prompt-tokens-details); `per_request_metrics` adds a one-choice reply's `metrics`
    (vLLM's --enable-per-request-metrics: request_timing.py)."""

    def __init__(self, tokenizer, model_name: str, reasoning: Optional[ReasoningParser] = None,
                 prompt_tokens_details: bool = False, per_request_metrics: bool = False):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.reasoning = reasoning
        # (chat usage counts reasoning tokens where there is a parser, vLLM's)
        self.markers = ReasoningMarkers.of(tokenizer) if reasoning is not None and tokenizer is not None else None
        self.prompt_tokens_details = prompt_tokens_details
        self.per_request_metrics = per_request_metrics

    async def stream_chunks(self, request_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int,
                            created: int, options: ReplyOptions) -> AsyncIterator[str]:
        """SSE chunks of (prompt index, output) pairs as they arrive (each output what is new:
        output_kind "delta"), then usage and [DONE]."""
        chat, n, echo, tools = options.chat, options.n, options.echo, options.tools
        num_choices = n * num_prompts
        choices_so_far: dict[int, _ChoiceSoFar] = {}
        prompt_tokens: dict[int, int] = {}  # per prompt, of the finished ones
        cached_tokens: dict[int, int] = {}
        prompts_seen: dict[int, int] = {}  # per prompt that has output, its tokens (continuous usage)
        kind = "chat.completion.chunk" if chat else "text_completion"
        role_pending = chat  # (chat's first chunk: the role)

        def chat_echo(prompt_index: int) -> str:
            return options.chat_echoes[prompt_index] if options.chat_echoes else ""

        def role_chunks(output: Optional[RequestOutput]) -> list[str]:
            """Each choice's first chunk, the role (one choice per chunk)."""
            chunks = []
            for i in range(num_choices):
                first = {"index": i, "delta": {"role": "assistant", "content": chat_echo(i // n)}, "logprobs": None,
                         "finish_reason": None}
                chunk = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                         "choices": [first]}
                if options.token_ids and output is not None:  # (vLLM: in the first chunks only)
                    chunk["prompt_token_ids"] = output.prompt_token_ids
                if options.prompt_text and output is not None:
                    chunk["prompt_text"] = output.prompt
                if options.continuous_usage and output is not None:  # (every chunk: the prompt so far, nothing generated)
                    chunk["usage"] = self.usage_of(output.num_prompt_tokens, 0)
                chunks.append(sse(chunk))
            return chunks

        if role_pending and not (options.token_ids or options.continuous_usage or options.prompt_text):
            for chunk in role_chunks(None):
                yield chunk
            role_pending = False
        async for prompt_index, output in outputs:
            if role_pending:  # (the role chunk carries the prompt's ids, or its usage: it waits for them)
                for chunk in role_chunks(output):
                    yield chunk
                role_pending = False
            choices = []
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                so_far = choices_so_far.get(index)
                if so_far is None:
                    so_far = choices_so_far[index] = _ChoiceSoFar(len(self.prompt_text(output)) if echo else 0)
                    if chat and self.counts_reasoning:
                        so_far.reasoning_tokens = ReasoningTokenCounter(self.reasoning, self.markers)
                elif so_far.finished:  # (with n > 1 a finished sample stays in its request's outputs)
                    continue
                so_far.receive(completion, keep_text=chat and (self.reasoning is not None or tools is not None))
                choice = (self._chat_chunk(index, completion, so_far, options) if chat
                          else self._completion_chunk(index, output, completion, so_far, options))
                if choice is not None:
                    choices.append(choice)
                    so_far.finished = choice["finish_reason"] is not None
            if choices and options.continuous_usage:
                prompts_seen[prompt_index] = output.num_prompt_tokens
            for choice in choices:  # (one per chunk, as vLLM: clients read choices[0])
                chunk = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                         "choices": [choice]}
                if options.continuous_usage:
                    num_generated = sum(so_far.num_tokens for so_far in choices_so_far.values())
                    chunk["usage"] = self.usage_of(sum(prompts_seen.values()), num_generated,
                                                   reasoning_tokens=reasoning_tokens_of(choices_so_far))
                yield sse(chunk)
            if output.finished:
                prompt_tokens[prompt_index] = output.num_prompt_tokens
                cached_tokens[prompt_index] = num_cached_tokens(output)
                if len(prompt_tokens) == num_prompts:
                    if options.include_usage:
                        num_generated = sum(so_far.num_tokens for so_far in choices_so_far.values())
                        usage = self.usage_of(sum(prompt_tokens.values()), num_generated, sum(cached_tokens.values()),
                                              reasoning_tokens_of(choices_so_far))
                        chunk = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                                 "choices": [], "usage": usage}
                        if self.per_request_metrics and num_choices == 1:
                            chunk["metrics"] = timing_metrics(output.metrics, num_generated)
                        yield sse(chunk)
                    yield "data: [DONE]\n\n"
                    return

    def _completion_chunk(self, index: int, output: RequestOutput, completion, so_far: _ChoiceSoFar,
                          options: ReplyOptions) -> Optional[dict]:
        """A completion choice's next chunk: its new text (after the prompt, the first, with
        `echo`) and the logprobs of the tokens received since the last chunk; None while there is
        no text to send (a character split across tokens)."""
        echo = options.echo
        text = completion.text
        first_chunk = not so_far.started
        if echo and first_chunk:
            text = self.prompt_text(output) + text
        if not text and completion.finish_reason is None:
            return None
        so_far.started = True
        pending = so_far.take_pending(completion)
        offset = so_far.text_offset
        logprobs = self.completion_logprobs(output, pending, 0, echo, echo and first_chunk, offset,
                                            options.tokens_as_ids)
        if logprobs is not None:
            # (offsets carry over from chunk to chunk: recomputing them would decode every earlier token)
            new_tokens = logprobs["tokens"][len(logprobs["tokens"]) - len(pending.token_ids):]
            so_far.text_offset = offset + sum(len(token) for token in new_tokens)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if options.token_ids:
            choice["token_ids"] = pending.token_ids
            if first_chunk:
                choice["prompt_token_ids"] = output.prompt_token_ids
        return choice

    def _chat_chunk(self, index: int, completion, so_far: _ChoiceSoFar, options: ReplyOptions) -> Optional[dict]:
        """A chat choice's next chunk, or None when nothing new can go out yet: new reasoning,
        new content (with tools: up to a possible call; calls go out whole at the end) and the
        logprobs of the tokens received since the last chunk. Without a reasoning parser or tools,
        the new text is the new content as it is (nothing reads the whole reply)."""
        tools = options.tools
        finished = completion.finish_reason is not None
        delta: dict = {}
        reason = completion.finish_reason
        if self.reasoning is None and tools is None:
            if completion.text:
                delta["content"] = completion.text
        else:
            reasoning, content = self.split_reasoning(so_far.text, finished)
            if len(reasoning) > so_far.reasoning_sent:
                if options.include_reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = reasoning[so_far.reasoning_sent:]
                so_far.reasoning_sent = len(reasoning)
            if tools is None or not finished:
                end = len(content) if tools is None else tools.streamable_len(content)
                if end > so_far.content_sent:
                    delta["content"] = content[so_far.content_sent:end]
                    so_far.content_sent = end
            else:
                rest, calls, reason = tools.finish_stream(content, so_far.content_sent, reason)
                if rest:
                    delta["content"] = rest
                if calls:
                    delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(calls)]
                so_far.content_sent = len(content)
        if not delta and not finished:
            return None
        pending = so_far.take_pending(completion)
        logprobs = None if tools is not None else self.chat_logprobs(pending, 0, options)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": completion.stop_reason}
        if options.token_ids:
            choice["token_ids"] = pending.token_ids
        return choice

    def split_reasoning(self, text: str, finished: bool = True) -> tuple[str, str]:
        """(reasoning, content) of a chat reply: all content without a reasoning parser."""
        return self.reasoning.split(text, finished) if self.reasoning is not None else ("", text)

    def prompt_text(self, output: RequestOutput) -> str:
        """The prompt as text ("" for token ids with no tokenizer: --skip-tokenizer-init)."""
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer is not None else ""

    def embeddings(self, outputs: list[EmbeddingRequestOutput], encoding_format: str) -> dict:
        """OpenAI's embeddings list; base64 is the little-endian float32 bytes, as OpenAI sends."""
        data = []
        for index, output in enumerate(outputs):
            vector = output.outputs.embedding
            if encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return {"object": "list", "data": data, "model": self.model_name, "usage": usage}

    def classifications(self, outputs: list[ClassificationRequestOutput], model_info) -> dict:
        """vLLM's /classify answer: per input its probabilities, their count and the label of the
        largest (the config's id2label)."""
        data = []
        for index, output in enumerate(outputs):
            probs = output.outputs.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": index, "label": model_info.class_label(best), "probs": probs,
                         "num_classes": len(probs)})
        usage = pooling_usage(sum(len(output.prompt_token_ids) for output in outputs))
        return {"id": "classify-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": self.model_name, "data": data, "usage": usage}

    def scores(self, scores: list[float], num_tokens: int) -> dict:
        """vLLM's /score answer: one score per pair, in order."""
        data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)]
        return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": self.model_name, "data": data, "usage": pooling_usage(num_tokens)}

    def reranked(self, documents: list[str], scores: list[float], top_n: Optional[int], num_tokens: int) -> dict:
        """vLLM's /rerank answer: the documents by descending score, the first `top_n` (all if unset)."""
        order = sorted(range(len(documents)), key=lambda index: -scores[index])[: top_n or None]
        ranked = [{"index": index, "document": {"text": documents[index]}, "relevance_score": scores[index]}
                  for index in order]
        return {"id": "rerank-" + uuid.uuid4().hex, "model": self.model_name, "results": ranked,
                "usage": pooling_usage(num_tokens)}

    def full_response(self, request_id: str, outputs: list, created: int, options: ReplyOptions) -> dict:
        chat, n, echo, tools = options.chat, options.n, options.echo, options.tools
        choices = []
        for prompt_index, output in enumerate(outputs):
            prefix = self.prompt_text(output) if echo else ""
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                if chat:
                    reasoning, content = self.split_reasoning(completion.text)
                    calls, reason = [], completion.finish_reason
                    if tools is not None:
                        content, calls, reason = tools.parse(content, completion.finish_reason)
                    if options.chat_echoes and options.chat_echoes[prompt_index]:
                        content = options.chat_echoes[prompt_index] + (content or "")
                    message = {"role": "assistant", "content": content}
                    if self.reasoning is not None:
                        message["reasoning_content"] = message["reasoning"] = (
                            reasoning or None if options.include_reasoning else None)
                    if calls:
                        message["tool_calls"] = calls
                    choice = {"index": index, "message": message, "finish_reason": reason,
                              "stop_reason": completion.stop_reason, "logprobs": self.chat_logprobs(completion, 0, options)}
                else:
                    choice = {"index": index, "text": prefix + completion.text, "finish_reason": completion.finish_reason,
                              "stop_reason": completion.stop_reason,
                              "logprobs": self.completion_logprobs(output, completion, 0, echo, echo,
                                                                   tokens_as_ids=options.tokens_as_ids),
                              "prompt_token_ids": output.prompt_token_ids if options.token_ids else None}
                choice["token_ids"] = completion.token_ids if options.token_ids else None
                if not chat:
                    choice["prompt_logprobs"] = self.prompt_logprobs(output, options)
                choices.append(choice)
        response = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": self.model_name, "choices": choices, "usage": self.usage(outputs, chat)}
        if self.per_request_metrics and len(choices) == 1:
            response["metrics"] = timing_metrics(outputs[0].metrics, len(outputs[0].outputs[0].token_ids))
        if chat and outputs:  # (one prompt)
            response["prompt_token_ids"] = outputs[0].prompt_token_ids if options.token_ids else None
            response["prompt_text"] = outputs[0].prompt if options.prompt_text else None
            response["prompt_logprobs"] = self.prompt_logprobs(outputs[0], options)
        return response

    def prompt_logprobs(self, output: RequestOutput, options: ReplyOptions) -> Optional[list]:
        """vLLM's prompt_logprobs: per prompt token (the first has none) {token id: {logprob,
        rank, decoded_token}} of the token and the k most likely; a rank where known (the token's
        own, when it is not among the k, is not)."""
        if options.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        decode, k = self.token_text(options.tokens_as_ids), options.prompt_logprobs
        described = []
        for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
            if entry is None:
                described.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda item: -item[1])
            among_k = len(entry) <= k or token_id not in entry
            ranks = {candidate: rank for rank, (candidate, _) in enumerate(ranked, 1)
                     if among_k or candidate != token_id}
            described.append({str(candidate): {"logprob": max(logprob, -9999.0), "rank": ranks.get(candidate),
                                               "decoded_token": decode([candidate])} for candidate, logprob in ranked})
        return described

    def token_text(self, tokens_as_ids: bool):
        """How logprobs name a token: its text, or "token_id:<id>" (return_tokens_as_token_ids, and
        always with no tokenizer: --skip-tokenizer-init)."""
        if tokens_as_ids or self.tokenizer is None:
            return lambda token_ids: f"token_id:{token_ids[0]}"
        return self.tokenizer.decode

    def completion_logprobs(self, output: RequestOutput, completion, first_token: int, echo: bool,
                            with_prompt: bool, text_offset: Optional[int] = None,
                            tokens_as_ids: bool = False) -> Optional[dict]:
        """OpenAI completion logprobs of tokens first_token.. of a completion, after the prompt's
        (from output.prompt_logprobs) when `with_prompt`. `text_offset` is token first_token's
        offset in the choice's text (by default: computed, after the prompt text with `echo`)."""
        if completion.logprobs is None:
            return None
        decode = self.token_text(tokens_as_ids)
        parts: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

        def add(token_ids: list[int], entries: list, offset: int) -> None:
            for token_id, entry in zip(token_ids, entries):
                token = decode([token_id])
                parts["tokens"].append(token)
                parts["token_logprobs"].append(None if entry is None else entry.get(token_id))
                parts["top_logprobs"].append(None if entry is None else {decode([t]): lp for t, lp in
                                                                         token_first(token_id, entry)})
                parts["text_offset"].append(offset)
                offset += len(token)

        if with_prompt:
            add(output.prompt_token_ids, output.prompt_logprobs, 0)
        if text_offset is None:
            text_offset = len(self.prompt_text(output)) if echo else 0
            text_offset += sum(len(decode([t])) for t in completion.token_ids[:first_token])
        add(completion.token_ids[first_token:], completion.logprobs[first_token:], text_offset)
        return parts

    def chat_logprobs(self, completion, first_token: int, options: ReplyOptions):
        """Chat logprobs of tokens first_token.. of a completion: each token's, and
        `options.top_logprobs` candidates: the sampled token, then the most likely others (vLLM's
        order; for a greedy token the k most likely)."""
        if completion.logprobs is None:
            return None
        decode, top_logprobs = self.token_text(options.tokens_as_ids), options.top_logprobs

        def described(token_id: int, logprob: float) -> dict:
            text = decode([token_id])
            return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8", "replace"))}

        content = []
        for entry, token in zip(completion.logprobs[first_token:], completion.token_ids[first_token:]):
            candidates = token_first(token, entry)
            content.append({**described(token, entry.get(token, -9999.0)),
                            "top_logprobs": [described(*candidate) for candidate in candidates[:top_logprobs]]})
        return {"content": content}

    def usage(self, outputs: list, chat: bool = False) -> dict:
        """Usage of whole (not delta) final outputs."""
        completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        cached_tokens = sum(num_cached_tokens(output) for output in outputs)
        reasoning_tokens = None
        if chat and self.counts_reasoning:
            reasoning_tokens = sum(count_reasoning_tokens(self.reasoning, self.markers, c.token_ids)
                                   for output in outputs for c in output.outputs)
        return self.usage_of(sum(output.num_prompt_tokens for output in outputs), completion_tokens, cached_tokens,
                             reasoning_tokens)

    @property
    def counts_reasoning(self) -> bool:
        """Whether chat usage carries `completion_tokens_details.reasoning_tokens`."""
        return self.markers is not None

    def usage_of(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                 reasoning_tokens: Optional[int] = None) -> dict:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens` (where enabled): prompt tokens the
        prefix cache served; `completion_tokens_details.reasoning_tokens` where counted."""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


def reasoning_tokens_of(choices: dict[int, "_ChoiceSoFar"]) -> Optional[int]:
    """Streamed choices' reasoning tokens so far, None where they are not counted."""
    counters = [so_far.reasoning_tokens for so_far in choices.values() if so_far.reasoning_tokens is not None]
    return sum(counter.count for counter in counters) if counters else None


def token_first(token_id: int, entry: dict[int, float]) -> list[tuple[int, float]]:
    """A token's logprob entry as vLLM lists it: the token itself, then the others, most likely first."""
    others = sorted((item for item in entry.items() if item[0] != token_id), key=lambda item: -item[1])
    return ([(token_id, entry[token_id])] if token_id in entry else []) + others


def num_cached_tokens(output) -> int:
    """Prompt tokens of a request the prefix cache served (not computed again)."""
    metrics = getattr(output, "metrics", None)
    return metrics.num_prefix_hit_tokens if metrics is not None else 0


def pooling_usage(num_tokens: int) -> dict:
    """Usage of requests that compute their prompts only."""
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}


class _ChoiceSoFar:
    """What a streamed choice received and sent so far, its outputs being deltas: its tokens
    (and logprobs) not yet sent with a chunk, the characters of reasoning and content sent, the
    text offset of its next token, and its whole text where a parser reads it (`keep_text`)."""

    def __init__(self, text_offset: int):
        self.text_offset = text_offset
        self.started = False
        self.finished = False  # (its finish_reason went out)
        self.num_tokens = 0
        self.reasoning_sent = self.content_sent = 0
        self.text = ""  # (kept only where a parser reads it)
        self.reasoning_tokens: Optional[ReasoningTokenCounter] = None  # (where chat usage counts them)
        self._pending_tokens: list[int] = []
        self._pending_logprobs: Optional[list] = None

    def receive(self, completion, keep_text: bool) -> None:
        self.num_tokens += len(completion.token_ids)
        if self.reasoning_tokens is not None:
            self.reasoning_tokens.add(completion.token_ids)
        self._pending_tokens += completion.token_ids
        if completion.logprobs is not None:
            self._pending_logprobs = (self._pending_logprobs or []) + completion.logprobs
        if keep_text:
            self.text += completion.text

    def take_pending(self, completion) -> CompletionOutput:
        """`completion` with the tokens and logprobs received since the last chunk (now sent)."""
        pending = dataclasses.replace(completion, token_ids=self._pending_tokens, logprobs=self._pending_logprobs)
        self._pending_tokens, self._pending_logprobs = [], None
        return pending
