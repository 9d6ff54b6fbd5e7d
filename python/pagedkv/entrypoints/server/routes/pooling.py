"""The pooling routes: /v1/embeddings, and vLLM's /classify, /score and /rerank (each also under
the prefixes vLLM serves it at) and Cohere's /v2/embed."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv.params.pooling import PoolingParams
from pagedkv.entrypoints.scoring import score_pairs, scores_of, scoring_requests
from pagedkv.entrypoints.server.cohere_embed import CohereEmbedRequest, truncated, typed_embeddings
from pagedkv.entrypoints.server.errors import APIError, too_many_tokens
from pagedkv.entrypoints.server.openapi import (ClassificationList, CohereEmbedResponse, EmbeddingList, RerankList,
                                                ScoreList, answer)
from pagedkv.entrypoints.server.protocol import ClassificationRequest, EmbeddingRequest, RerankRequest, ScoreRequest
from pagedkv.entrypoints.server.serving import ServingContext, make_params, serving

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/embeddings", responses=answer(EmbeddingList))
async def embeddings(body: EmbeddingRequest, request: Request, context: ServingContext = Depends(serving)):
    served = context.check_model(body.model)
    inputs = make_params(body.inputs)
    check_dimensions(context, "dimensions", body.dimensions)
    outputs = await pool(context, request, "embd-", inputs, PoolingParams(), body.priority, served)
    return context.builders[served].embeddings(outputs, body.encoding_format)


@router.post("/v2/embed", responses=answer(CohereEmbedResponse))
async def cohere_embed(body: CohereEmbedRequest, request: Request, context: ServingContext = Depends(serving)):
    """Cohere's embed API (vLLM's /v2/embed): the texts' embeddings in the types asked for."""
    served = context.check_model(body.model)
    texts = make_params(body.text_inputs)
    check_dimensions(context, "output_dimension", body.output_dimension)
    if any(len(text) > 16 * context.max_prompt_chars for text in texts):  # (bounded tokenizing work)
        raise APIError(400, f"texts: a text is far longer than max_model_len={context.max_model_len} tokens",
                       "invalid_request_error", "texts", "context_length_exceeded")
    tokenizer = context.text_tokenizer()
    encoded = await context.client.run_in_worker(lambda: [tokenizer.encode(text) for text in texts])
    inputs = []
    for token_ids in encoded:
        kept = truncated(token_ids, body.truncate, context.max_model_len)
        if kept is None:
            raise too_many_tokens("texts", len(token_ids), context.max_model_len)
        inputs.append(kept)
    outputs = await pool(context, request, "embd-", inputs, PoolingParams(), body.priority, served)
    vectors = [output.outputs.embedding for output in outputs]
    return {"id": "embd-" + uuid.uuid4().hex, "texts": texts, "response_type": "embeddings_by_type",
            "embeddings": typed_embeddings(vectors, body.embedding_types or ["float"]),
            "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": sum(map(len, inputs))}}}


def check_dimensions(context: ServingContext, field: str, dimensions) -> None:
    """A 400 for an embedding size other than the model's (it has no smaller ones)."""
    hidden_size = context.model_info.hidden_size
    if dimensions is not None and dimensions != hidden_size:
        raise APIError(400, f"{field}={dimensions} is not supported: this model's embeddings have {hidden_size}",
                       "invalid_request_error", field)


@router.post("/classify", responses=answer(ClassificationList))
@router.post("/v1/classify", responses=answer(ClassificationList))
async def classify(body: ClassificationRequest, request: Request, context: ServingContext = Depends(serving)):
    """vLLM's /classify: each input's class probabilities and most likely label, from a
    sequence-classification checkpoint."""
    served = context.check_model(body.model)
    inputs = make_params(body.inputs)
    if not context.model_info.is_classifier:
        raise APIError(400, f"model {served!r} is not a sequence classifier (*ForSequenceClassification)",
                       "invalid_request_error", "model")
    params = PoolingParams(task="classify", use_activation=body.use_activation)
    outputs = await pool(context, request, "classify-", inputs, params, body.priority, served)
    return context.builders[served].classifications(outputs, context.model_info)


@router.post("/score", responses=answer(ScoreList))
@router.post("/v1/score", responses=answer(ScoreList))
async def score(body: ScoreRequest, request: Request, context: ServingContext = Depends(serving)):
    """vLLM's /score: a relevance score per (text_1, text_2) pair."""
    served = context.check_model(body.model)
    scores, num_tokens = await scored(context, request, lambda: score_pairs(body.text_1, body.text_2), "score-",
                                      body.priority, served)
    return context.builders[served].scores(scores, num_tokens)


@router.post("/rerank", responses=answer(RerankList))
@router.post("/v1/rerank", responses=answer(RerankList))
@router.post("/v2/rerank", responses=answer(RerankList))
async def rerank(body: RerankRequest, request: Request, context: ServingContext = Depends(serving)):
    """vLLM's /rerank: the documents, most relevant to the query first (the best `top_n`)."""
    served = context.check_model(body.model)
    scores, num_tokens = await scored(context, request, lambda: score_pairs(body.query, body.documents), "rerank-",
                                      body.priority, served)
    return context.builders[served].reranked(body.documents, scores, body.top_n, num_tokens)


async def scored(context: ServingContext, request: Request, pairs_of, prefix: str, priority: int,
                 served: str) -> tuple[list[float], int]:
    """(a score per pair (pagedkv.entrypoints.scoring), prompt tokens computed), or a 400 naming what is wrong."""
    try:
        pairs = pairs_of()
        prompts, params = scoring_requests(pairs, context.text_tokenizer(), context.model_info.num_labels)
    except ValueError as error:
        raise APIError(400, str(error), "invalid_request_error")
    outputs = await pool(context, request, prefix, prompts, params, priority, served)
    scores = [score for score, _ in scores_of(pairs, prompts, outputs, params)]
    return scores, sum(len(output.prompt_token_ids) for output in outputs)


async def pool(context: ServingContext, request: Request, prefix: str, inputs: list, params: PoolingParams,
               priority: int, served: str) -> list:
    """Queues one pooling request per input (all or none) and waits for their outputs (see
    ServingContext.final_outputs: a client that leaves aborts them)."""
    request_id = prefix + uuid.uuid4().hex
    request_ids = [f"{request_id}-{i}" for i in range(len(inputs))]
    streams = await context.submit(request_ids, inputs, params, priority, served, chat=False, prompt_field="input")
    return await context.final_outputs(request, streams)
