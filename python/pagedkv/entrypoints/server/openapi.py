"""What /openapi.json says about the answers: a pydantic model of each route's JSON body (as
responses.py and responses_api.py build them), the error model, the `responses=` each route
declares, and the corrections FastAPI's generated document needs (errors are JSON on every route;
no route answers 422, validation errors are 400).

The models only document: routes return plain dicts, which FastAPI neither validates nor
serializes again. tests/server/test_server_hardening.py fuzzes the live server and checks every answer
against them, so a body that drifts from its model fails there. Fields OpenAI's spec has and
pagedkv leaves out are absent; extra fields are allowed (a model's schema does not forbid them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pagedkv.entrypoints.server.protocol import ResponsesNamedToolChoice, ResponsesTool, TextConfig

FinishReason = Optional[str]  # "stop", "length", "tool_calls", "abort", "repetition"; None while a stream runs
# vLLM's: the stop string or stop token id that ended a choice ("repetition_detected" for
# repetition_detection); None otherwise
StopReason = Optional[Union[int, str]]


# -- errors ------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    """Every error answer: OpenAI's shape, `param` naming the field at fault where one is."""

    error: ErrorDetail


# -- completions and chat ----------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens the prefix cache served (their KV was not computed again)."""


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int
    """Generated tokens of the reasoning (chat, with --reasoning-parser): a think block's, GPT-OSS's analysis messages'."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None


class CompletionLogprobs(BaseModel):
    """Per token (the prompt's first, with echo): its text, logprob, top candidates and offset in
    the choice's text; the prompt's first token has no logprob (None)."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """A prompt token's candidate: keyed by its token id."""

    logprob: float
    rank: Optional[int] = None  # (1 = the most likely; unknown for the prompt's token when not among the k)
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    stop_reason: StopReason = None
    logprobs: Optional[CompletionLogprobs]
    prompt_token_ids: Optional[list[int]] = None  # (return_token_ids)
    token_ids: Optional[list[int]] = None  # (return_token_ids)
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None  # (prompt_logprobs)


class Completion(BaseModel):
    """/v1/completions: choice `i * n + j` is sample `j` of prompt `i`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float  # (-9999.0 stands for minus infinity, as in vLLM: JSON has no infinities)
    bytes: Optional[list[int]] = None


class TokenLogprob(BaseModel):
    token: str
    logprob: Optional[float]
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatCompletionMessage(BaseModel):
    """The reply; `reasoning_content` (and vLLM's newer name `reasoning`) with a reasoning parser."""

    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason
    stop_reason: StopReason = None
    logprobs: Optional[ChatLogprobs]
    token_ids: Optional[list[int]] = None  # (return_token_ids)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_token_ids: Optional[list[int]] = None  # (return_token_ids)
    prompt_text: Optional[str] = None  # (return_prompt_text: the rendered chat template)
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None  # (prompt_logprobs)


# -- Responses API -----------------------------------------------------------------------------
class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    status: str
    content: list[ReasoningText]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class MessageOutput(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: str
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    status: str
    name: str
    arguments: str
    namespace: Optional[str] = None  # (a namespaced tool's call)


OutputItem = Annotated[Union[ReasoningOutput, MessageOutput, FunctionCallOutput], Field(discriminator="type")]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str


class ResponseBody(BaseModel):
    """/v1/responses: the reply as output items, with the request's settings repeated."""

    id: str
    object: Literal["response"]
    created_at: float
    model: str
    status: Literal["completed", "incomplete", "in_progress", "queued", "cancelled", "failed"]
    incomplete_details: Optional[IncompleteDetails]
    error: Optional[dict[str, Any]]
    output: list[OutputItem]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    temperature: float
    top_p: float
    metadata: dict[str, str]
    parallel_tool_calls: bool
    tools: list[ResponsesTool]
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]
    text: TextConfig
    top_logprobs: int
    store: bool
    usage: Optional[ResponseUsage]


# -- pooling -----------------------------------------------------------------------------------
class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]  # str: base64 of little-endian float32 (encoding_format "base64")


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: PoolingUsage


class Classification(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationList(BaseModel):
    """vLLM's /classify."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Classification]
    usage: PoolingUsage


class Score(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(BaseModel):
    """vLLM's /score: one score per pair, in order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankList(BaseModel):
    """vLLM's /rerank: the documents by descending score."""

    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage


# -- the rest ----------------------------------------------------------------------------------
class ModelCard(BaseModel):
    """A served model: the base model (`root` its checkpoint), or a LoRA adapter (`root` its
    directory, `parent` the base model)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: Optional[str] = None
    parent: Optional[str] = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class CohereEmbedResponse(BaseModel):
    """Cohere's /v2/embed answer: `embeddings` holds a list per type asked for (float, binary,
    ubinary, base64)."""

    id: str
    embeddings: dict[str, list[Any]]
    texts: Optional[list[str]] = None
    meta: Optional[dict[str, Any]] = None
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


class DecisionResponse(BaseModel):
    """/v1/decisions: an answer per question (predicate: probability; choice: choice, probabilities,
    confidence; score: score, probabilities, confidence) and the reads' usage."""

    model: str
    answers: list[dict[str, Any]]
    usage: dict[str, Any]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None  # (return_token_strs)


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration (its init arguments), class and chat template."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeResponse(BaseModel):
    prompt: str


class StatusResponse(BaseModel):
    status: str


class ServerLoadResponse(BaseModel):
    server_load: int


class VersionResponse(BaseModel):
    version: str


# -- what routes declare -----------------------------------------------------------------------
ERROR_RESPONSES: dict = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "The request is malformed or asks for more than the server allows; `param` names the field"),
    (401, "Missing or wrong API key"),
    (404, "Unknown model or route"),
    (409, "Conflicts with the server's state"),
    (413, "The body exceeds max_request_body_bytes"),
    (499, "The client closed the connection before the answer"),
    (500, "A fault of the server's own; the message carries the request id it was logged with"),
    (503, "Overloaded or shutting down: retry after Retry-After seconds"),
)}


def answer(model: type[BaseModel], description: str = "Successful Response") -> dict:
    """`responses=` of a route whose 200 is `model`'s JSON."""
    return {200: {"model": model, "description": description}}


def streamed_answer(model: type[BaseModel]) -> dict:
    """`responses=` of a route that answers `model`'s JSON, or with "stream": true server-sent events."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "The answer, or with stream: true its server-sent events"}}


def text_answer(description: str) -> dict:
    """`responses=` of a route whose 200 is plain text."""
    return {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": description}}


def install_openapi(app: FastAPI) -> None:
    """Makes app.openapi() FastAPI's document, corrected: every error is the error JSON, also on
    routes whose success is plain text (FastAPI gives their errors the route's media type),
    and no route declares the 422 FastAPI adds for bodies: its validation errors are 400s here."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = generate()
            for operations in document.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    for status, response in responses.items():
                        if int(status) >= 400 and "application/json" not in response.get("content", {}):
                            response["content"] = {"application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            schemas = document.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
