"""EngineConfig: every engine option with its default, validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import secrets
from dataclasses import dataclass
from typing import Optional

from pagedkv.errors import InvalidConfigError

_PREEMPTION_MODES = ("auto", "swap", "recompute")
_SCHEDULING_POLICIES = ("fcfs", "priority")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class EngineConfig:
    """Options of `LLMEngine` / `LLM` (also the CLI's engine flags)."""

    model: Optional[str] = None
    """Local HF checkpoint dir (config.json + safetensors) or a .gguf file; None = embedded SmolLM2-135M-Instruct."""
    gguf_file: Optional[str] = None
    """GGUF file name inside `model` (a directory)."""
    tokenizer: Optional[str] = None
    """Tokenizer dir or .gguf file, when it is not next to the weights."""
    skip_tokenizer_init: bool = False
    """vLLM's: load no tokenizer (a checkpoint without one serves). Prompts are token ids (text,
    chat messages, stop strings, bad words and structured outputs are refused: they need one) and
    outputs carry token ids with empty text; a router or client tokenizes on its side."""
    load_format: str = "auto"
    """auto: the checkpoint's weights; dummy (vLLM's name): random weights of the right shapes and
    dtype, built from `model`'s config.json alone (no weight files read), for benchmarks at real
    model shapes. A directory without a tokenizer needs `tokenizer`."""
    gguf_weights: str = "auto"
    """A GGUF's quantized linear weights: auto (the default: quantized where it applies, else
    dequantized, silently), quantized (kept as GGUF blocks, Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, and a BF16
    file's weights as bfloat16, multiplied by the CPU's kernels: float32 on one CPU, Llama-family
    models, the token embedding table too; warns and dequantizes elsewhere) or dequantized (to the
    model's dtype at load). Kept Q4_1 weights decode ~2.5-3x faster than float32 ones at 1 to 64
    tokens a step and prefill ~1.5x faster, in a fifth of the memory (docs/benchmarks.md, "Against
    llama.cpp"). They round activations to 8 bits as llama.cpp does, so greedy tokens can part
    from dequantized weights' at near-ties; dequantized is the choice for comparisons with
    transformers. With dtype auto, a GGUF whose linears are kept runs float32 activations."""
    generation_config: str = "auto"
    """Where default sampling parameters come from (vLLM's option): auto = the model's
    generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens, where it sets them), vllm = pagedkv's own defaults,
    or a directory holding a generation_config.json. Requests that set a field keep their value."""
    dtype: str = "auto"
    """Weights and KV dtype: auto, float32, float16, bfloat16. auto is bfloat16 on CUDA and on CPUs
    with native bfloat16 math (AVX512-BF16 or AMX, where it runs ~2x faster), else float32; and
    float32 on the CPU for a GGUF whose linears are kept as stored (gguf_weights: quantized blocks,
    or a BF16 file's bfloat16)."""
    kv_cache_dtype: str = "auto"
    """KV cache element type: auto (the model's dtype; a BF16 GGUF kept beside float32 activations
    on a CPU with native bfloat16 math: bfloat16, as its bfloat16 model's), bfloat16 (with float32
    activations on the CPU: half float32's bytes; K/V, the attention's query and output rounded to
    bfloat16), or fp8 = fp8_e4m3 (float8_e4m3fn) or fp8_e5m2, vLLM's names: one byte per element,
    so twice the blocks of a bfloat16 cache in the same memory. float8 values are stored unscaled
    (vLLM's scale of 1.0 without calibration) and saturate at the format's largest value (448 for
    e4m3, 57344 for e5m2)."""
    device: str = "cpu"
    """cpu or cuda."""
    block_size: int = 16
    """Tokens per KV block."""
    num_device_blocks: Optional[int] = None
    """KV blocks on the device; None = from kv_cache_memory_bytes."""
    kv_cache_memory_bytes: Optional[int] = None
    """KV budget in bytes when num_device_blocks is None (default 512 MiB on CPU, 90% of free GPU memory)."""
    swap_space_bytes: int = 1 << 30
    """CPU swap space for preempted sequences, in bytes."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step."""
    max_model_len: Optional[int] = None
    """Longest prompt + output; None = min(model limit, 8192)."""
    max_waiting_requests: int = 1024
    """Waiting-queue bound; beyond it requests get OverloadedError (HTTP 503)."""
    max_logprobs: int = 20
    """Most candidates per token a request may ask logprobs of (logprobs, prompt_logprobs; the
    server's logprobs / top_logprobs), vLLM's option and default; -1 = the vocabulary size.
    Beyond it a request is refused with a ValueError (HTTP 400) naming the field."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes."""
    disable_hybrid_kv_cache_manager: bool = False
    """For models that mix sliding-window and full-attention layers (Gemma 2/3, GPT-OSS, OLMo 3,
    Qwen's layer_types): False (the default) gives each kind of layer its own block tables
    (KV-cache groups, runner/kv_groups.py), so windowed layers hold only their window's blocks;
    True keeps every block for every layer, as vLLM's flag of that name does."""
    prefix_caching_hash_seed: Optional[int] = None
    """Root of the prefix cache's block names (hashes chained from it). None = a secret random seed
    per engine, as vLLM seeds its root from os.urandom: names cannot be computed outside the
    engine, so no prompt can be crafted to collide with another user's cached blocks. With
    PYTHONHASHSEED set, None derives the seed from it (vLLM's rule), for names that agree across
    engines and restarts."""
    enable_cpu_prefix_cache: bool = False
    """Prefix-cache blocks evicted from the device move to free CPU swap blocks and are copied
    back on a hit instead of recomputed (vLLM's KV offloading to CPU). Needs prefix caching."""
    kv_events_endpoint: Optional[str] = None
    """Publish KV-cache events (blocks stored, removed, all cleared, per tier) on this ZMQ PUB
    address in vLLM's wire format, for KV-aware routers (Dynamo's indexer, llm-d, the vLLM
    router): `tcp://*:5557` binds, `tcp://host:5557` connects. None = off. Needs prefix caching
    and `pip install 'pagedkv[kv-events]'` (pyzmq, msgspec)."""
    kv_events_replay_endpoint: Optional[str] = None
    """ZMQ ROUTER address where subscribers ask for batches they missed (vLLM's replay socket)."""
    kv_events_topic: str = ""
    """Topic of every published KV event batch."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    long_prefill_token_threshold: int = 0
    """Most tokens one request's prefill takes in a step (vLLM's option; 0 = only the budget
    limits it): a long prompt then leaves room in each step for shorter ones, whose first
    tokens come sooner, at some cost to the long one's."""
    preemption_mode: str = "auto"
    """auto, swap or recompute."""
    scheduling_policy: str = "fcfs"
    """fcfs (arrival order) or priority: requests carry a priority (smaller first, ties by arrival)
    and one that cannot start preempts running requests of lower priority."""
    watermark: float = 0.01
    """Fraction of device blocks kept free at admission."""
    seed: int = 0
    """Seed of the global RNG (unseeded requests)."""
    attention_backend: str = "auto"
    """A name in pagedkv.attention.registry.BACKENDS: torch (reference), cpu (reference + Rust decode
    attention), cuda (kernels); or auto (cuda on a GPU, cpu on the CPU)."""
    num_threads: Optional[int] = None
    """torch CPU threads; None = torch's default."""
    num_speculative_tokens: int = 0
    """Speculative decoding by prompt lookup (vLLM's ngram method): up to this many draft tokens
    per step, copied from where the sequence's last tokens occurred before, verified in one
    forward pass; 0 = off. Greedy requests without penalties, biases or logprobs speculate;
    their outputs are the same as without it."""
    prompt_lookup_max: int = 4
    """Longest n-gram looked up for drafts."""
    prompt_lookup_min: int = 2
    """Shortest n-gram looked up for drafts."""
    speculative_disable_by_batch_size: Optional[int] = 4
    """No drafts while this many requests or more are unfinished (vLLM's option of that name):
    verifying drafts costs compute that a large batch already saturates. None = always draft."""
    enable_lora: bool = False
    """Serve LoRA adapters per request (`lora_request=LoRARequest(name, id, path)`, a PEFT
    directory): requests with different adapters, or none, share batches."""
    max_lora_rank: int = 16
    """Largest LoRA rank accepted (vLLM's default 16)."""
    max_cpu_loras: Optional[int] = None
    """Adapters kept loaded; beyond it the least recently used one is dropped (requests running
    with it keep it) and loaded again when next named. None = every adapter stays."""
    enable_prompt_embeds: bool = False
    """Accept prompts given as embeddings (`{"prompt_embeds": tensor [length, hidden_size]}`, the
    server's `prompt_embeds`) in place of token ids: they replace the token embedding lookup for
    the prompt's positions (vLLM's flag). Off by default, as in vLLM: a client's tensor goes
    straight into the model."""
    max_cached_grammars: int = 64
    """Compiled structured-output grammars kept for reuse (least recently used dropped first); each
    holds token masks, about 1 MiB for a small JSON schema."""
    tensor_parallel_size: int = 1
    """Processes (one GPU each on CUDA) the model is sharded over, Megatron style: attention
    heads, the KV cache's heads and MLP columns split, one all-reduce after each attention and
    MLP. pagedkv starts the other ranks itself, or joins a torchrun launch (multi-node); rank 0
    schedules and samples. The Llama family (Llama, Mistral, Qwen2/3, SmolLM, Granite, ...)."""
    distributed_timeout_seconds: float = 120.0
    """How long a collective may wait for a tensor-parallel rank before the engine fails with an
    error (a dead or hung worker). Starting the ranks may take at least 60 s whatever this is."""
    async_scheduling: bool = False
    """True plans each step while the device still runs the one before (vLLM's async scheduling):
    a decode's input token is read on the device from the step that sampled it, and the host
    books that step's tokens (stop checks, detokenizing, outputs) while the next step runs, so
    each step's outputs come one step later. Steps whose sampling needs the host's books first
    (beams, speculative decoding, logprobs, penalties, biases, structured output, prompt
    logprobs, pooling) and tensor-parallel steps run synchronously. Off by default until it has
    been measured on a GPU; on a CPU it only reorders work."""
    cpu_linear_kernel: bool = True
    """On the CPU, linear layers and the LM head with few rows (decode steps) run in Rust
    (pagedkv.layers.cpu_linear: each weight read once, near the memory bandwidth) instead of
    torch's matrix products; False leaves every one to torch (baselines)."""
    enforce_eager: bool = False
    """True launches every decode kernel from Python. False (the default) captures CUDA graphs
    of decode steps at start-up where they apply (cuda device and attention backend, no
    mixture of experts; see cuda_graphs.py): 4.3x the decode throughput on an H100."""

    def __post_init__(self) -> None:
        def fail(field: str, value: object, rule: str) -> None:
            raise InvalidConfigError(f"{field} must be {rule}, got {value!r}")

        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            fail("generation_config", self.generation_config, "'auto', 'vllm' or an existing directory")
        if self.dtype not in _DTYPES:
            fail("dtype", self.dtype, f"one of {_DTYPES}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            fail("kv_cache_dtype", self.kv_cache_dtype, f"one of {_KV_CACHE_DTYPES}")
        if self.kv_cache_dtype == "bfloat16" and self.is_cuda and self.dtype not in ("auto", "bfloat16"):
            fail("kv_cache_dtype", self.kv_cache_dtype, f"the model's dtype on CUDA (dtype={self.dtype!r}): a bfloat16 "
                 "cache beside other activations runs on the CPU only")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            fail("device", self.device, "'cpu' or 'cuda[:N]'")
        if self.block_size not in (8, 16, 32, 64, 128):
            fail("block_size", self.block_size, "8, 16, 32, 64 or 128")
        for field in ("num_device_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                fail(field, value, "a positive integer or None")
        for field in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "max_cached_grammars"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                fail(field, value, "a positive integer")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            fail("max_logprobs", self.max_logprobs, "an integer >= 0, or -1 (the vocabulary size)")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            fail("long_prefill_token_threshold", self.long_prefill_token_threshold, "an integer >= 0")
        seed = self.prefix_caching_hash_seed
        if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 1 << 64):
            fail("prefix_caching_hash_seed", seed, "None or an integer in [0, 2**64)")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            fail("swap_space_bytes", self.swap_space_bytes, "an integer >= 0")
        if self.preemption_mode not in _PREEMPTION_MODES:
            fail("preemption_mode", self.preemption_mode, f"one of {_PREEMPTION_MODES}")
        if not isinstance(self.num_speculative_tokens, int) or not 0 <= self.num_speculative_tokens <= 16:
            fail("num_speculative_tokens", self.num_speculative_tokens, "an integer in [0, 16]")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            fail("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, "None or >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            fail("prompt_lookup_min", (self.prompt_lookup_min, self.prompt_lookup_max), "1 <= min <= prompt_lookup_max")
        if self.scheduling_policy not in _SCHEDULING_POLICIES:
            fail("scheduling_policy", self.scheduling_policy, f"one of {_SCHEDULING_POLICIES}")
        if not 0 <= self.watermark < 1:
            fail("watermark", self.watermark, "in [0, 1)")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            fail("max_lora_rank", self.max_lora_rank, "a positive integer")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < 1):
            fail("max_cpu_loras", self.max_cpu_loras, "None or a positive integer")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", self.tensor_parallel_size, "a positive integer")
        if not self.distributed_timeout_seconds > 0:
            fail("distributed_timeout_seconds", self.distributed_timeout_seconds, "a positive number of seconds")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            fail("kv_events_endpoint", self.kv_events_endpoint, "None unless enable_prefix_caching")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            fail("kv_events_replay_endpoint", self.kv_events_replay_endpoint, "None unless kv_events_endpoint is set")
        if self.load_format not in ("auto", "dummy"):
            fail("load_format", self.load_format, "auto or dummy")
        if self.gguf_weights not in ("auto", "dequantized", "quantized"):
            fail("gguf_weights", self.gguf_weights, "auto, dequantized or quantized")
        # (The name itself is checked where backends are registered: pagedkv.attention.registry.)
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            fail("attention_backend", self.attention_backend, "a backend's name")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.is_cuda or cpu_has_native_bfloat16() else torch.float32
        return getattr(torch, self.dtype)

    def resolved_prefix_caching_hash_seed(self) -> int:
        """prefix_caching_hash_seed, else one derived from PYTHONHASHSEED, else a random one."""
        if self.prefix_caching_hash_seed is not None:
            return self.prefix_caching_hash_seed
        python_hash_seed = os.environ.get("PYTHONHASHSEED", "")
        if python_hash_seed.isdigit():
            digest = hashlib.sha256(f"pagedkv prefix cache {python_hash_seed}".encode()).digest()
            return int.from_bytes(digest[:8], "little")
        return secrets.randbits(64)

    def kv_cache_torch_dtype(self):
        """The KV cache's element type (the model's dtype for kv_cache_dtype='auto')."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype()
        if self.kv_cache_dtype == "bfloat16":
            return torch.bfloat16
        return torch.float8_e5m2 if self.kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn


def engine_config(model: Optional[str], options: dict) -> EngineConfig:
    """EngineConfig(model=model, **options), with a TypeError listing the valid names for unknown ones."""
    known = {field.name for field in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown engine options {unknown}; valid: {sorted(known)}")
    return EngineConfig(model=model, **options)


@functools.lru_cache(maxsize=None)
def cpu_has_native_bfloat16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16, read
    from /proc/cpuinfo). Elsewhere torch emulates bfloat16 matmuls, slower than float32 ones."""
    try:
        with open(cpuinfo_path) as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return bool({"avx512_bf16", "amx_bf16"} & set(line.partition(":")[2].split()))
    except OSError:
        pass
    return False
