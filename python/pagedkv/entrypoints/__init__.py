"""How people drive the engine: `LLM` (offline), `AsyncLLM` (streams), the engine loop
thread, the CLI and the OpenAI-compatible server."""
