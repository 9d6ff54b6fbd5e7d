"""vLLM's /tokenize (a prompt, or chat messages through the template), /detokenize, and
(`info_router`, with enable_tokenizer_info_endpoint) /tokenizer_info."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends

from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.params.sampling import check_unicode
from pagedkv.entrypoints.server.errors import APIError, too_many_tokens
from pagedkv.entrypoints.server.openapi import DetokenizeResponse, TokenizeResponse, TokenizerInfoResponse, answer
from pagedkv.entrypoints.server.protocol import DetokenizeRequest, TokenizeRequest
from pagedkv.entrypoints.server.serving import ServingContext, serving

router = APIRouter(route_class=OffLoopJSONRoute)
info_router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/tokenize", responses=answer(TokenizeResponse))
async def tokenize(body: TokenizeRequest, context: ServingContext = Depends(serving)):
    context.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "invalid_request_error", "prompt")
    if body.messages is not None:
        text = await context.chat_prompt(body.messages, body.add_generation_prompt, None, body.chat_template_kwargs,
                                         chat_template=body.chat_template)
    else:
        text = body.prompt
    context.check_text_fits(text, "prompt")  # (bounded work: not millions of tokens returned)
    try:
        check_unicode(text, "prompt")
    except ValueError as error:
        raise APIError(400, str(error), "invalid_request_error", "prompt")
    add_special_tokens = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
    tokenizer = context.text_tokenizer()
    tokens = await context.client.run_in_worker(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
    strings = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": context.max_model_len, "tokens": tokens, "token_strs": strings}


@router.post("/detokenize", responses=answer(DetokenizeResponse))
async def detokenize(body: DetokenizeRequest, context: ServingContext = Depends(serving)):
    context.check_model(body.model)
    if len(body.tokens) > context.max_model_len:  # (as vLLM: bounded work, the bound /tokenize has)
        raise too_many_tokens("tokens", len(body.tokens), context.max_model_len)
    vocab_size, tokenizer = context.model_info.vocab_size, context.text_tokenizer()

    def decoded() -> Optional[str]:  # (on the worker pool: a long list takes the loop's time otherwise)
        if any(not 0 <= token < vocab_size for token in body.tokens):
            return None
        return tokenizer.decode(body.tokens)

    text = await context.client.run_in_worker(decoded)
    if text is None:
        raise APIError(400, f"tokens must be token ids in [0, {vocab_size})", "invalid_request_error", "tokens")
    return {"prompt": text}


@info_router.get("/tokenizer_info", responses=answer(TokenizerInfoResponse))
async def tokenizer_info(context: ServingContext = Depends(serving)):
    """vLLM's: the tokenizer's init arguments (JSON values only), its class, name and chat template."""
    tokenizer = context.text_tokenizer()
    config = {name: value for name, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if name not in ("tokenizer_object", "added_tokens_decoder") and _is_json(value)}
    config["name_or_path"] = getattr(tokenizer, "name_or_path", "")
    config["tokenizer_class"] = type(tokenizer).__name__
    template = context.chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _is_json(value) -> bool:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(item) for item in value)
    return isinstance(value, dict) and all(isinstance(key, str) and _is_json(item) for key, item in value.items())
