"""SageMaker's routes, as vLLM serves them: GET/POST /ping (health) and POST /invocations, which
hands a body to the first route whose request it is: chat, completion, embedding, classification,
score, rerank; or with `requestType` opens or closes a stateful session (sagemaker_sessions.py).
(Left out of /openapi.json: they are the platform's, and /invocations takes any of the others'
bodies.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest,
                                                 EmbeddingRequest, RerankRequest, ScoreRequest)
from pagedkv.entrypoints.server.routes import admin, completions, pooling
from pagedkv.entrypoints.server.sagemaker_sessions import CLOSED_SESSION_ID, NEW_SESSION_ID, SESSION_ID, SessionRequest
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
    session_id = request.headers.get(SESSION_ID)
    if "requestType" in body:
        return session_request(body, session_id, context)
    if session_id is not None:
        check_session(context, session_id)
    for request_type, route in INVOCATIONS:
        try:
            parsed = request_type.model_validate(body)
        except ValidationError:
            continue
        return await route(parsed, request, context)
    names = ", ".join(request_type.__name__ for request_type, _ in INVOCATIONS)
    raise APIError(400, f"the body is none of the requests /invocations serves ({names})", "invalid_request_error",
                   None)


def session_request(body: dict, session_id, context: ServingContext) -> PlainTextResponse:
    """NEW_SESSION or CLOSE, answered with the session's id in the standard's headers."""
    sessions = context.sagemaker_sessions
    if sessions is None:
        raise APIError(400, "Invalid payload. stateful sessions not enabled", "invalid_request_error", "requestType")
    try:
        kind = SessionRequest.model_validate(body).requestType
    except ValidationError as error:
        raise APIError(400, f"Bad request: {error.errors(include_url=False)}", "invalid_request_error",
                       "requestType") from None
    if kind == "NEW_SESSION":
        try:
            session_id, announced = sessions.open()
        except ValueError as error:
            raise APIError(424, f"Failed to create session: {error}", "invalid_request_error", "requestType") from None
        return PlainTextResponse(f"Session {session_id} created", headers={NEW_SESSION_ID: announced})
    if not session_id:  # (the standard's status for it: 424)
        raise APIError(424, f"Failed to close session: invalid session_id: {session_id}", "invalid_request_error",
                       SESSION_ID)
    check_session(context, session_id)
    sessions.close(session_id)
    return PlainTextResponse(f"Session {session_id} closed", headers={CLOSED_SESSION_ID: session_id})


def check_session(context: ServingContext, session_id: str) -> None:
    """A 400 unless the session an invocation names is open (or when sessions are off)."""
    if context.sagemaker_sessions is None:
        raise APIError(400, f"Invalid payload. stateful sessions not enabled, {SESSION_ID} header not supported",
                       "invalid_request_error", SESSION_ID)
    try:
        context.sagemaker_sessions.check(session_id)
    except ValueError as error:
        raise APIError(400, f"Bad request: {error}", "invalid_request_error", SESSION_ID) from None
