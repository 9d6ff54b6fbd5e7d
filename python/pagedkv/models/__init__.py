"""Model architectures, one file each."""

from pagedkv.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
