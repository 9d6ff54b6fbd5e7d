"""Model architectures, one file each."""

from pagedkv.models.cohere import CohereForCausalLM
from pagedkv.models.deepseek_v2 import DeepseekV2ForCausalLM
from pagedkv.models.ernie4_5_moe import Ernie45MoeForCausalLM
from pagedkv.models.falcon import FalconForCausalLM
from pagedkv.models.gemma import GemmaForCausalLM
from pagedkv.models.glm4 import Glm4ForCausalLM
from pagedkv.models.glm4_moe import Glm4MoeForCausalLM
from pagedkv.models.gpt2 import GPT2ForCausalLM
from pagedkv.models.gpt_bigcode import GPTBigCodeForCausalLM
from pagedkv.models.gpt_neox import GPTNeoXForCausalLM
from pagedkv.models.gptj import GPTJForCausalLM
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.minimax_m2 import MiniMaxM2ForCausalLM
from pagedkv.models.nemotron import NemotronForCausalLM
from pagedkv.models.olmo import OlmoForCausalLM
from pagedkv.models.olmo2 import Olmo2ForCausalLM
from pagedkv.models.opt import OPTForCausalLM
from pagedkv.models.phi import PhiForCausalLM
from pagedkv.models.stablelm import StableLmForCausalLM
from pagedkv.models.starcoder2 import Starcoder2ForCausalLM

__all__ = ["CohereForCausalLM", "DeepseekV2ForCausalLM", "Ernie45MoeForCausalLM", "FalconForCausalLM", "GemmaForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "GPT2ForCausalLM", "GPTBigCodeForCausalLM", "GPTNeoXForCausalLM", "GPTJForCausalLM",
           "LlamaForCausalLM", "MiniMaxM2ForCausalLM", "NemotronForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM", "OPTForCausalLM", "PhiForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM"]
