"""Model architectures, one file each."""

from pagedkv.models.gemma3 import Gemma3ForCausalLM
from pagedkv.models.llama import LlamaForCausalLM

__all__ = ["Gemma3ForCausalLM", "LlamaForCausalLM"]
