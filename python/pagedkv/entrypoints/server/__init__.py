"""OpenAI-compatible HTTP server over LLMEngine (FastAPI + uvicorn)."""

from pagedkv.entrypoints.server.app import create_app, serve

__all__ = ["create_app", "serve"]
