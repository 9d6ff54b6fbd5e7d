"""/v1/responses: OpenAI's Responses API (server/responses_api.py builds its bodies and events)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from fastapi import APIRouter, Depends, Request

from pagedkv.engine.input_processor import text_prompt
from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.openapi import ResponseBody, answer, streamed_answer
from pagedkv.entrypoints.server.protocol import ResponsesRequest
from pagedkv.entrypoints.server.responses import ReplyOptions
from pagedkv.entrypoints.server.responses_api import ResponseState, usage as responses_usage
from pagedkv.entrypoints.server.serving import (ServingContext, make_params, next_output, serving, streamed_output_kind,
                                     with_tools)

router = APIRouter(route_class=OffLoopJSONRoute)
logger = logging.getLogger("pagedkv.entrypoints.server")


@router.post("/v1/responses", responses=streamed_answer(ResponseBody))
async def responses(body: ResponsesRequest, request: Request, context: ServingContext = Depends(serving)):
    """OpenAI's Responses API, whole or streamed as events; stored (`store`, the default) to be read
    back or continued by `previous_response_id`. A `background` response is answered at once
    ("queued") and made while the client polls it (GET /v1/responses/{id}) or cancels it."""
    served = context.check_model(body.model)
    params = make_params(lambda: body.responses_params(max(1, context.max_model_len // 2),
                                                       context.generation_defaults))
    history = []
    if body.previous_response_id is not None:
        previous = context.responses_store.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous_response_id {body.previous_response_id!r} names no stored response",
                           "invalid_request_error", "previous_response_id")
        history = previous.conversation
    messages = make_params(lambda: body.messages(history))
    conversation = history + make_params(body.input_messages)  # (instructions are not carried over)
    chat_tools, tool_choice = make_params(body.chat_tools)
    tools = context.tool_calling(chat_tools, tool_choice, parallel=body.parallel_tool_calls is not False)
    params = context.with_reasoning(with_tools(params, tools, "text.format"), template_kwargs=body.template_kwargs())
    prompt = await context.chat_prompt(messages, True, chat_tools if tools is not None else None,
                                       body.template_kwargs())
    response = ResponseState(served, body, context.reasoning, tools)
    builder, logprob_options = context.builders[served], ReplyOptions(chat=True, top_logprobs=body.top_logprobs or 0,
                                                                         tokens_as_ids=context.tokens_as_ids)

    def logprobs_of(completion) -> list:
        """The Responses API's logprob entries of a completion's tokens (the chat API's form)."""
        if not body.includes_logprobs:
            return []
        return (builder.chat_logprobs(completion, 0, logprob_options) or {"content": []})["content"]

    params = dataclasses.replace(params, output_kind=streamed_output_kind(params) if body.stream else "final_only")
    [stream] = await context.submit([response.id], [text_prompt(prompt)], params, body.priority, served, chat=False,
                                    prompt_field="input", check_context_room=body.max_output_tokens is not None)

    async def events():
        yield "".join(response.start())
        output, reply, token_ids = None, "", []
        while output is None or not output.finished:
            output = await next_output(stream)  # (what is new: output_kind "delta")
            completion = output.outputs[0]
            reply += completion.text
            token_ids += completion.token_ids
            response.pending_logprobs += logprobs_of(completion)
            text = "".join(response.update(reply, completion.finish_reason, output.finished))
            if text:
                yield text
        response.keep_raw_messages(output, reply, token_ids)
        final = response.finish(completion.finish_reason, responses_usage(output, len(token_ids),
                                                                     context.reasoning_token_count(token_ids)))
        store(response.final_body)
        yield "".join(final)

    def store(whole: dict) -> None:
        if body.store:
            context.responses_store.put(response.id, whole, conversation + response.reply_messages())

    if body.stream:
        return context.event_stream([stream], events())
    if body.background:
        return make_in_background(context, response, stream, store, logprobs_of)
    [output] = await context.final_outputs(request, [stream])
    completion = output.outputs[0]
    response.keep_raw_messages(output, completion.text, completion.token_ids)
    whole = response.complete(completion.text, completion.finish_reason,
                              responses_usage(output, reasoning_tokens=context.reasoning_token_count(completion.token_ids)),
                              logprobs_of(completion))
    store(whole)
    return whole


@router.get("/v1/responses/{response_id}", responses=answer(ResponseBody))
async def stored_response(response_id: str, context: ServingContext = Depends(serving)):
    """A response created with `store` (the newest 1024 are kept, in memory)."""
    return stored_or_404(context, response_id).body


def stored_or_404(context: ServingContext, response_id: str):
    """The stored response `response_id`, else a 404 naming it."""
    stored = context.responses_store.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", "invalid_request_error", "response_id")
    return stored


def make_in_background(context: ServingContext, response: ResponseState, stream, store, logprobs_of) -> dict:
    """Stores the response as "queued", makes it in a task of its own (stored again, as
    "in_progress", then as it ends: completed, incomplete, cancelled or failed) and returns the
    queued body."""
    queued = response.body("queued")
    store(queued)

    async def make() -> None:
        with context.aborting_unfinished([stream]):  # (a cancel aborts the engine request)
            try:
                store(response.body("in_progress"))
                output = None
                while output is None or not output.finished:
                    output = await next_output(stream)
                completion = output.outputs[0]
                response.keep_raw_messages(output, completion.text, completion.token_ids)
                usage = responses_usage(output, reasoning_tokens=context.reasoning_token_count(completion.token_ids))
                store(response.complete(completion.text, completion.finish_reason, usage, logprobs_of(completion)))
            except asyncio.CancelledError:
                store(response.body("cancelled"))
            except Exception as error:  # (the engine stopped, a failed step): the poller sees it
                logger.warning("background response %s failed: %s", response.id, error)
                store({**response.body("failed"), "error": {"code": "server_error", "message": str(error)}})
            finally:
                context.responses_store.running.pop(response.id, None)

    context.responses_store.running[response.id] = asyncio.get_running_loop().create_task(make())
    return queued


@router.post("/v1/responses/{response_id}/cancel", responses=answer(ResponseBody))
async def cancel_response(response_id: str, context: ServingContext = Depends(serving)):
    """Stops a background response still being made; answers it as stored then ("cancelled")."""
    stored = stored_or_404(context, response_id)
    if not stored.body["background"]:
        raise APIError(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
    task = context.responses_store.running.get(response_id)
    if task is None:
        raise APIError(400, f"response {response_id!r} has already ended ({stored.body['status']})",
                       "invalid_request_error", "response_id")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return context.responses_store.get(response_id).body
