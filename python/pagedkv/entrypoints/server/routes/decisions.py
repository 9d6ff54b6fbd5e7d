"""OpenAI's Decisions API (/v1/decisions, as vLLM serves it): server/decisions.py."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request

from pagedkv.engine.input_processor import text_prompt
from pagedkv.entrypoints.server.decisions import DecisionRequest, label_token_ids, question_prompt, read_answer
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.entrypoints.server.openapi import DecisionResponse, answer
from pagedkv.entrypoints.server.protocol import ChatMessage
from pagedkv.entrypoints.server.responses import num_cached_tokens
from pagedkv.entrypoints.server.serving import ServingContext, serving
from pagedkv.params.sampling import SamplingParams

router = APIRouter(route_class=OffLoopJSONRoute)
NO_THINKING = {"enable_thinking": False}  # (a read is the reply's first token)


@router.post("/v1/decisions", responses=answer(DecisionResponse))
async def decisions(body: DecisionRequest, request: Request, context: ServingContext = Depends(serving)):
    """Each question read from the model's next token after it: its options' probabilities."""
    served = context.check_model(body.model)
    if body.joint:
        raise APIError(400, "joint: this model reads each question on its own; joint reads need DiffusionGemma",
                       "invalid_request_error", "joint")
    text = body.text()
    context.check_text_fits(text, "input")  # (before rendering it once per question)
    label_ids = await decision_label_ids(context)
    prompts = await asyncio.gather(*(
        context.chat_prompt([ChatMessage(role="user", content=question_prompt(text, question))], True, None,
                            NO_THINKING) for question in body.questions))
    width = max(len(question.options()) for question in body.questions)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=label_ids[:width],
                            cache_salt=body.cache_salt, output_kind="final_only")
    request_id = "decision-" + uuid.uuid4().hex
    prompts = [text_prompt(prompt) for prompt in prompts]
    streams = await context.submit([f"{request_id}-{i}" for i in range(len(prompts))], prompts, params, 0,
                                   served, chat=False, prompt_field="input")
    finals = await context.final_outputs(request, streams)
    answers = [read_answer(question, final.outputs[0].logprobs[0], label_ids)
               for question, final in zip(body.questions, finals)]
    input_tokens = sum(final.num_prompt_tokens for final in finals)
    output_tokens = sum(len(final.outputs[0].token_ids) for final in finals)
    return {"model": served, "answers": answers, "usage": {
        "input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
        "input_tokens_details": {"cached_tokens": sum(num_cached_tokens(final) for final in finals),
                                 "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0}}}


async def decision_label_ids(context: ServingContext) -> list[int]:
    """The labels' tokens as a reply's first token with this model's chat template (found once)."""
    if context.decision_label_ids is None:
        probe = await context.chat_prompt([ChatMessage(role="user", content="x")], True, None, NO_THINKING)
        tokenizer = context.text_tokenizer()
        try:
            context.decision_label_ids = await context.client.run_in_worker(
                lambda: label_token_ids(tokenizer, tokenizer.encode(probe, add_special_tokens=False)))
        except ValueError as error:
            raise APIError(400, f"this model cannot answer decisions: {error}", "invalid_request_error", "model")
    return context.decision_label_ids
