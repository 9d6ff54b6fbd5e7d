"""The server's own routes: /health, /v1/models, /metrics, /version, /reset_prefix_cache, and
(`lora_router`, with allow_runtime_lora_updating) vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, and SageMaker's POST /adapters and DELETE /adapters/{name}."""

from __future__ import annotations

import logging
import os
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagedkv.entrypoints.server.json_body import OffLoopJSONRoute
from pagedkv import __version__
from pagedkv.params.lora_request import LoRARequest
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.openapi import ModelList, ServerLoadResponse, StatusResponse, VersionResponse, answer
from pagedkv.entrypoints.server.protocol import LoadLoRAAdapterRequest, SageMakerAdapterRequest, UnloadLoRAAdapterRequest
from pagedkv.entrypoints.server.serving import ServingContext, serving

logger = logging.getLogger("pagedkv.entrypoints.server")



def same_site_only(request: Request) -> None:
    """The routes that change the server's state answer 403 to a browser's cross-site request: a
    page elsewhere can send a body-less POST without a CORS preflight (CSRF). Browsers name the
    page's origin (`Origin`, `Sec-Fetch-Site`); clients that are not browsers (curl, SDKs) send
    neither and are served as before."""
    origin = request.headers.get("origin")
    cross_origin = origin is not None and urlsplit(origin).netloc != request.headers.get("host")
    if cross_origin or request.headers.get("sec-fetch-site") == "cross-site":
        raise APIError(403, f"{request.url.path} does not answer cross-site requests (origin {origin!r})",
                       "permission_error", None)


router = APIRouter(route_class=OffLoopJSONRoute)
lora_router = APIRouter(dependencies=[Depends(same_site_only)], route_class=OffLoopJSONRoute)


@router.get("/health", responses={**answer(StatusResponse),
                                  503: {"model": StatusResponse, "description": "The engine loop has stopped"}})
async def health(context: ServingContext = Depends(serving)):
    if not context.client.is_running:
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models", responses=answer(ModelList))
async def models(context: ServingContext = Depends(serving)):
    card = {"id": context.model_name, "object": "model", "created": 0, "owned_by": "pagedkv",
            "root": context.model_root, "parent": None, "max_model_len": context.max_model_len}
    lora_cards = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedkv", "root": adapter.lora_path,
                   "parent": context.adapter_parents.get(name, context.model_name), "max_model_len": context.max_model_len}
                  for name, adapter in context.adapters.items()]
    return {"object": "list", "data": [card, *lora_cards]}


@router.get("/load", responses=answer(ServerLoadResponse))
async def load(request: Request):
    """vLLM's: the requests in flight on the routes that use the engine (0 unless the server runs
    with --enable-server-load-tracking)."""
    return {"server_load": request.app.state.server_load.in_flight}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(context: ServingContext = Depends(serving)):
    return Response(context.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/reset_prefix_cache", responses=answer(StatusResponse), dependencies=[Depends(same_site_only)])
async def reset_prefix_cache(context: ServingContext = Depends(serving)):
    """vLLM's: forgets every cached prefix (after a weight update); 409 while requests run."""
    if not await context.client.reset_prefix_cache():
        raise APIError(409, "the prefix cache cannot be reset while requests are unfinished", "conflict_error", None)
    return {"status": "ok"}


@lora_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, context: ServingContext = Depends(serving)):
    await load_adapter(context, body.lora_name, body.lora_path)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@lora_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, context: ServingContext = Depends(serving)):
    await unload_adapter(context, body.lora_name)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


@lora_router.post("/adapters", response_class=PlainTextResponse, include_in_schema=False)
async def sagemaker_load_adapter(body: SageMakerAdapterRequest, context: ServingContext = Depends(serving)):
    """SageMaker's form of /v1/load_lora_adapter: {"name", "src"}."""
    await load_adapter(context, body.name, body.src)
    return Response(f"Success: LoRA adapter '{body.name}' added successfully.", media_type="text/plain")


@lora_router.delete("/adapters/{adapter_name}", response_class=PlainTextResponse, include_in_schema=False)
async def sagemaker_unload_adapter(adapter_name: str, context: ServingContext = Depends(serving)):
    """SageMaker's form of /v1/unload_lora_adapter."""
    await unload_adapter(context, adapter_name)
    return Response(f"Success: LoRA adapter '{adapter_name}' removed successfully.", media_type="text/plain")


async def load_adapter(context: ServingContext, name: str, path: str) -> None:
    if not os.path.isdir(path):  # (vLLM's NotFoundError, a 404)
        raise APIError(404, f"No adapter found at {path!r}: no such directory", "invalid_request_error",
                       "lora_path", "adapter_not_found")
    async with context.adapter_updates:  # (loads at once: each name checked and each id taken once)
        if name == context.model_name or name in context.adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "invalid_request_error",
                           "lora_name")
        adapter = LoRARequest(name, next(context.adapter_ids), path)
        try:
            await context.client.add_lora(adapter)
        except ValueError as error:  # (InvalidConfigError: the message names what is wrong)
            raise APIError(400, str(error), "invalid_request_error", "lora_path") from error
        context.adapters[name] = adapter
        context.builders[name] = context.builder(name)
    logger.info("LoRA adapter %r loaded from %s", name, path)


async def unload_adapter(context: ServingContext, name: str) -> None:
    adapter = context.adapters.pop(name, None)
    if adapter is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "invalid_request_error",
                       "lora_name", "model_not_found")
    context.builders.pop(name, None)
    await context.client.remove_lora(adapter.lora_int_id)


@router.get("/version", responses=answer(VersionResponse))
async def version():
    return {"version": __version__}
