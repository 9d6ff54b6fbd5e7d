"""The server's routes, one APIRouter per family, all over the app's ServingContext:
completions (and chat), responses, pooling (embeddings, classify, score, rerank),
tokenization, and admin (health, models, metrics, version, prefix cache, LoRA adapters)."""
