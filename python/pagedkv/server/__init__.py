"""OpenAI-compatible HTTP server over LLMEngine (FastAPI + uvicorn)."""

from pagedkv.server.app import create_app, serve

__all__ = ["create_app", "serve"]
