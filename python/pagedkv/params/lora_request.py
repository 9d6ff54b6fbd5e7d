"""Which LoRA adapter a request runs with (vLLM's `LoRARequest`); the runner loads and applies
adapters (pagedkv.runner.lora)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """The adapter one request runs with: a name (the server's model name), an id unique per
    adapter (> 0), and the PEFT directory holding it."""

    lora_name: str
    lora_int_id: int
    lora_path: str
