"""/v1/completions and /v1/chat/completions, whole or streamed (SSE)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Optional

from fastapi import APIRouter, Depends, Request

from pagedkv.engine.input_processor import text_prompt
from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.entrypoints.server.openapi import ChatCompletion, Completion, answer, streamed_answer
from pagedkv.entrypoints.server.prompt_embeds import decode_prompt_embeds, embeds_marker, spliced_prompt
from pagedkv.entrypoints.server.protocol import (BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest,
                                                RequestFieldError)
from pagedkv.entrypoints.server.responses import ReplyOptions
from pagedkv.entrypoints.server.serving import ServingContext, make_params, merged, serving, streamed_output_kind, with_tools
from pagedkv.entrypoints.server.tools import ToolCalling
from pagedkv.params.sampling import SamplingParams

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/completions", responses=streamed_answer(Completion))
async def completions(body: CompletionRequest, request: Request, context: ServingContext = Depends(serving)):
    served = context.check_model(body.model)
    params = make_params(lambda: body.completion_params(context.generation_defaults))
    # (embeddings are decoded off the event loop: megabytes of base64 and torch.load)
    prompts = make_params(body.prompts) if not body.prompt_embeds else await asyncio.to_thread(make_params, body.prompts)
    return await run(context, request, prompts, params, body, served, chat=False)


@router.post("/v1/chat/completions", responses=streamed_answer(ChatCompletion))
async def chat_completions(body: ChatCompletionRequest, request: Request, context: ServingContext = Depends(serving)):
    return await answer_chat(body, request, context)


@router.post("/v1/chat/completions/batch", responses=answer(ChatCompletion))
async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request,
                                 context: ServingContext = Depends(serving)):
    """vLLM's batched chat: each conversation of `messages` answered as its own chat completion,
    all in one response (choice i * n + j: sample j of conversation i)."""
    return await answer_chat(body, request, context)


async def answer_chat(body: ChatCompletionRequest, request: Request, context: ServingContext):
    """A chat completion of each of the body's conversations (one, or a batch's)."""
    served = context.check_model(body.model)
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens = body.max_completion_tokens
    default_max = max(1, context.max_model_len // 2)
    params = make_params(lambda: body.sampling_params(body.chat_logprobs(), default_max, context.generation_defaults))
    chat_tools, tool_choice = body.chat_tools()
    tools = context.tool_calling(chat_tools, tool_choice, parallel=body.parallel_tool_calls is not False)
    params = context.with_reasoning(with_tools(params, tools, "structured outputs (response_format, guided_*)"),
                                    body.thinking_token_budget, body.template_kwargs(), body.include_reasoning)
    forwarded = body.forwarded_prompt_token_ids(context.model_info.vocab_size)
    if forwarded is not None:
        if isinstance(body, BatchChatCompletionRequest):
            raise RequestFieldError("kv_transfer_params", "kv_transfer_params.prompt_token_ids is one prompt's: "
                                                          "not with a batch of conversations")
        return await run(context, request, [forwarded], params, body, served, chat=True, tools=tools)
    prompts = await asyncio.gather(*(chat_prompt(context, body, conversation, chat_tools if tools is not None else None)
                                     for conversation in body.conversations()))
    return await run(context, request, list(prompts), params, body, served, chat=True, tools=tools)


async def chat_prompt(context: ServingContext, body: ChatCompletionRequest, conversation, chat_tools):
    """A conversation's prompt: its rendered text, or with prompt_embeds parts the token ids and
    embeddings the engine takes (decoded and tokenized off the event loop)."""
    embeds = [part.data for message in conversation for part in message.embeds_parts()]
    marker = embeds_marker() if embeds else ""
    text = await context.chat_prompt(conversation, body.add_generation_prompt, chat_tools, body.template_kwargs(),
                                     body.continue_final_message, marker, body.chat_template)
    if not embeds:
        return text_prompt(text, body.add_special_tokens)
    return await asyncio.to_thread(make_params, lambda: spliced_prompt(text, marker, decode_prompt_embeds(embeds),
                                                                       context.text_tokenizer(), body.add_special_tokens))


async def run(context: ServingContext, request: Request, prompts: list, params, body, served: str, chat: bool,
              tools: Optional[ToolCalling] = None):
    """Queues one engine request per prompt (all or none), with the adapter `served` names if
    it is one, and answers with their choices."""
    builder = context.builders[served]
    # (vLLM's request_id names the reply; the engine's own ids stay unique if a client repeats it)
    request_id = ("chatcmpl-" if chat else "cmpl-") + (body.request_id or uuid.uuid4().hex)
    engine_id = request_id if body.request_id is None else f"{request_id}-{uuid.uuid4().hex[:12]}"
    request_ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
    params = dataclasses.replace(params, output_kind=streamed_output_kind(params) if body.stream else "final_only")
    streams = await context.submit(request_ids, prompts, params, body.priority, served, chat,
                                   check_context_room=body.max_tokens is not None)
    created = int(time.time())
    stream_options = body.stream_options
    include_usage = context.force_include_usage or (stream_options is not None and stream_options.include_usage)
    options = ReplyOptions(chat=chat, n=params.n, echo=not chat and body.echo, include_usage=include_usage,
                           chat_echoes=tuple(body.echoed_texts()) if chat else (),
                           continuous_usage=context.force_include_usage or (
                               include_usage and stream_options is not None and stream_options.continuous_usage_stats),
                           tools=tools, top_logprobs=listed_logprobs(params), token_ids=bool(body.return_token_ids),
                           tokens_as_ids=bool(body.return_tokens_as_token_ids) or context.tokens_as_ids, prompt_logprobs=body.prompt_logprobs,
                           include_reasoning=not chat or body.include_reasoning,
                           prompt_text=chat and bool(body.return_prompt_text))
    if body.stream:
        chunks = builder.stream_chunks(request_id, merged(streams), len(streams), created, options)
        return context.event_stream(streams, chunks)
    finals = await context.final_outputs(request, streams)
    return builder.full_response(request_id, finals, created, options)


def listed_logprobs(params: SamplingParams) -> int:
    """Chat's top_logprobs entries per token: the k asked, or every one of logprob_token_ids and
    the sampled token."""
    if params.logprob_token_ids:
        return len(params.logprob_token_ids) + 1
    return params.logprobs or 0
