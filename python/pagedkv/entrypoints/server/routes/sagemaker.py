"""SageMaker's routes, as vLLM serves them: GET/POST /ping (health) and POST /invocations, which
hands a body to the first route whose request it is: chat, completion, embedding, classification,
score, rerank. (Left out of /openapi.json: they are the platform's, and /invocations takes
any of the others' bodies.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest,
                                                 EmbeddingRequest, RerankRequest, ScoreRequest)
from pagedkv.entrypoints.server.routes import admin, completions, pooling
from pagedkv.entrypoints.server.serving import ServingContext, serving

router = APIRouter(route_class=OffLoopJSONRoute)

# In vLLM's order: the first request type a body validates as takes it.
INVOCATIONS = ((ChatCompletionRequest, completions.chat_completions), (CompletionRequest, completions.completions),
               (EmbeddingRequest, pooling.embeddings), (ClassificationRequest, pooling.classify),
               (ScoreRequest, pooling.score), (RerankRequest, pooling.rerank))


@router.get("/ping", include_in_schema=False)
@router.post("/ping", include_in_schema=False)
async def ping(context: ServingContext = Depends(serving)):
    return await admin.health(context)


@router.post("/invocations", include_in_schema=False)
async def invocations(request: Request, context: ServingContext = Depends(serving)):
    body = await request.json()
    if not isinstance(body, dict):
        raise APIError(400, "an invocation's body is a JSON object", "invalid_request_error", None)
    for request_type, route in INVOCATIONS:
        try:
            parsed = request_type.model_validate(body)
        except ValidationError:
            continue
        return await route(parsed, request, context)
    names = ", ".join(request_type.__name__ for request_type, _ in INVOCATIONS)
    raise APIError(400, f"the body is none of the requests /invocations serves ({names})", "invalid_request_error",
                   None)
