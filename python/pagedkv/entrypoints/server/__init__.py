"""OpenAI-compatible HTTP server over LLMEngine (FastAPI + uvicorn)."""

__all__ = ["create_app", "serve"]


def __getattr__(name: str):
    # (Lazy: the body-screening child imports a module of this package without the app's imports.)
    if name in __all__:
        from pagedkv.entrypoints.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'pagedkv.entrypoints.server' has no attribute {name!r}")
