"""vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedkv.params.sampling import check_unicode
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.openapi import DetokenizeResponse, TokenizeResponse, answer
from pagedkv.entrypoints.server.protocol import DetokenizeRequest, TokenizeRequest
from pagedkv.entrypoints.server.serving import ServingContext, serving

router = APIRouter()


@router.post("/tokenize", responses=answer(TokenizeResponse))
async def tokenize(body: TokenizeRequest, context: ServingContext = Depends(serving)):
    context.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "invalid_request_error", "prompt")
    if body.messages is not None:
        text = await context.chat_prompt(body.messages, body.add_generation_prompt, None, body.chat_template_kwargs)
    else:
        text = body.prompt
    try:
        check_unicode(text, "prompt")
    except ValueError as error:
        raise APIError(400, str(error), "invalid_request_error", "prompt")
    tokens = await context.client.run_in_worker(
        lambda: context.tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
    return {"count": len(tokens), "max_model_len": context.max_model_len, "tokens": tokens}


@router.post("/detokenize", responses=answer(DetokenizeResponse))
async def detokenize(body: DetokenizeRequest, context: ServingContext = Depends(serving)):
    context.check_model(body.model)
    vocab_size = context.model_info.vocab_size
    if any(not 0 <= token < vocab_size for token in body.tokens):
        raise APIError(400, f"tokens must be token ids in [0, {vocab_size})", "invalid_request_error", "tokens")
    return {"prompt": await context.client.run_in_worker(context.tokenizer.decode, body.tokens)}
