"""Model architectures, one file each."""

from pagedkv.models.gemma import GemmaForCausalLM
from pagedkv.models.llama import LlamaForCausalLM

__all__ = ["GemmaForCausalLM", "LlamaForCausalLM"]
