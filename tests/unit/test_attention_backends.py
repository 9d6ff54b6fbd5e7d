"""The attention backend contract: every registered backend satisfies AttentionBackend, the
registry picks backends by name, and a step's StepContext prepares the backend once."""

import inspect

import pytest
import torch

from pagedkv.attention import BACKENDS, AttentionBackend, AttentionMetadata, StepContext, TorchRefBackend, get_backend
from pagedkv.attention.cuda import CudaAttentionBackend
from pagedkv import LLM
from pagedkv.config import EngineConfig
from pagedkv.errors import InvalidConfigError

PROTOCOL_METHODS = ("check_supported", "prepare", "write_kv", "forward", "copy_blocks")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_satisfies_the_protocol(name):
    backend_class = BACKENDS[name]
    backend = backend_class()
    assert isinstance(backend, AttentionBackend)
    assert backend.name == name
    assert isinstance(backend_class.supports_cuda_graphs, bool)  # declared on the class, not probed
    for method in PROTOCOL_METHODS:  # the Protocol's parameters, by name and order (isinstance checks presence)
        want = list(inspect.signature(getattr(AttentionBackend, method)).parameters)
        got = list(inspect.signature(getattr(backend_class, method)).parameters)
        assert got == want, f"{backend_class.__name__}.{method}{got} is not AttentionBackend.{method}{want}"


def test_a_class_without_the_contract_is_no_backend():
    class NoGraphFlag:
        name = "partial"

        def check_supported(self, device, head_dim): ...
        def prepare(self, metadata): ...
        def write_kv(self, key_cache, value_cache, key, value, slot_mapping): ...
        def forward(self, query, key_cache, value_cache, metadata, scale, sliding_window=None, logit_softcap=None,
                    sinks=None): ...
        def copy_blocks(self, kv_cache, pairs): ...

    assert not isinstance(NoGraphFlag(), AttentionBackend)
    NoGraphFlag.supports_cuda_graphs = False
    assert isinstance(NoGraphFlag(), AttentionBackend)


def test_the_registry_picks_backends_by_name():
    assert type(get_backend("torch", "cpu")) is TorchRefBackend
    assert type(get_backend("cpu", "cpu")) is BACKENDS["cpu"]
    assert type(get_backend("auto", "cpu")) is BACKENDS["cpu"]
    assert type(get_backend("cuda", "cpu", head_dim=64)) is CudaAttentionBackend  # (kernels for head dim 64)
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'torch', 'cpu', 'cuda'"):
        get_backend("flash", "cpu")
    with pytest.raises(ValueError, match="runs on the CPU"):  # the backend's own check_supported
        get_backend("cpu", "cuda")


def test_a_new_backend_is_one_registry_line(monkeypatch):
    class EchoBackend(TorchRefBackend):
        name = "echo"

    monkeypatch.setitem(BACKENDS, "echo", EchoBackend)
    assert type(get_backend("echo", "cpu")) is EchoBackend
    assert EngineConfig(attention_backend="echo").attention_backend == "echo"


def test_the_registry_alone_decides_which_names_are_backends(monkeypatch):
    """The config takes any name; the registry refuses an unknown one, naming the known ones, and
    the runner asks it before loading the model."""
    for name in ("auto", *BACKENDS):
        EngineConfig(attention_backend=name)
    with pytest.raises(InvalidConfigError, match="attention_backend"):
        EngineConfig(attention_backend="")
    with pytest.raises(InvalidConfigError, match="attention_backend must be one of 'auto', 'torch'.*got 'flash'"):
        get_backend("flash", "cpu")
    monkeypatch.setattr("pagedkv.runner.model_runner.load", lambda *args, **kwargs: pytest.fail("loaded"))
    with pytest.raises(InvalidConfigError, match="got 'flash'"):
        LLM(model="no-such-model", attention_backend="flash")


def mixed_step_metadata() -> AttentionMetadata:
    """A prefill chunk of 3 tokens ending at position 5, then two decodes (contexts 4 and 2)."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 4, 5], dtype=torch.int32),
        context_lens=torch.tensor([5, 4, 2], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1], [2, 0], [3, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([2, 3, 4, 11, 13], dtype=torch.int64),
        max_query_len=3, max_context_len=5, num_decode_tokens=2,
        query_start_loc_host=[0, 3, 4, 5], context_lens_host=[5, 4, 2],
    )


def test_the_cuda_backend_prepares_the_token_layout_once_per_step():
    metadata = mixed_step_metadata()
    assert metadata.token_layout is None
    StepContext.build(metadata, kv_cache=None, backend=CudaAttentionBackend())
    seq_index, context_lens = metadata.token_layout
    assert seq_index.tolist() == [0, 0, 0, 1, 2]
    assert context_lens.tolist() == [3, 4, 5, 4, 2]  # each token sees the positions up to its own


class CountingBackend(TorchRefBackend):
    """The torch reference, counting the calls of a step."""

    def __init__(self):
        self.calls = []

    def prepare(self, metadata):
        self.calls.append("prepare")

    def write_kv(self, *args):
        self.calls.append("write_kv")
        super().write_kv(*args)

    def forward(self, *args, **options):
        self.calls.append("forward")
        return super().forward(*args, **options)


def test_a_model_reads_one_step_context():
    """One StepContext carries the step down every layer: the backend is prepared once, then
    each layer writes its K/V into its own layer of the cache and attends over it."""
    from transformers import LlamaConfig

    from pagedkv.models.llama import LlamaForCausalLM
    from pagedkv.models.registry import resolve_traits
    from pagedkv.runner.kv_cache import KVCache

    torch.manual_seed(0)
    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(hf_config, resolve_traits(hf_config), 64, torch.float32)
    kv_cache = KVCache(3, 1, 16, 4, 8, 0, torch.float32, "cpu")
    metadata = mixed_step_metadata()
    backend = CountingBackend()
    with torch.inference_mode():
        hidden = model(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([2, 3, 4, 3, 1]),
                       StepContext.build(metadata, kv_cache, backend))
    assert hidden.shape == (5, 32)
    assert backend.calls == ["prepare"] + ["write_kv", "forward"] * 3
    for layer in range(3):  # each layer's keys went to its own cache: slot 11 is block 2, offset 3
        key_cache, _ = kv_cache.layer(layer)
        assert key_cache[2, :, 3].abs().sum() > 0
    assert kv_cache.layer(0)[0][2, :, 3].ne(kv_cache.layer(1)[0][2, :, 3]).any()
