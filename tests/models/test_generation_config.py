"""Default sampling parameters from the model's generation_config.json (vLLM's
`generation_config="auto"`): requests that leave a field unset sample with the model's value."""

import shutil

import httpx
import pytest
from transformers import GenerationConfig

from pagedkv import LLM, SamplingParams
from pagedkv.errors import InvalidConfigError
from pagedkv.models.loader import generation_defaults
from pagedkv.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest

QWEN3_STYLE = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1, max_new_tokens=5)


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_qwen2_dir, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("generation_config") / "model"
    shutil.copytree(tiny_qwen2_dir, directory)
    GenerationConfig(eos_token_id=2, bos_token_id=1, **QWEN3_STYLE).save_pretrained(directory)
    return str(directory)


def test_only_the_sampling_fields_a_config_changes_become_defaults():
    expected = dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1, max_tokens=5)
    assert generation_defaults(GenerationConfig(**QWEN3_STYLE)) == expected
    # fields the config leaves out are not the model's choice (nor are the non-sampling ones)
    assert generation_defaults(GenerationConfig(eos_token_id=2, do_sample=True, num_beams=1)) == {}
    assert generation_defaults(None) == {}


def test_llm_samples_with_the_models_defaults_unless_told_otherwise(model_with_generation_config):
    llm = LLM(model_with_generation_config, dtype="float32", num_device_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    assert (defaults.repetition_penalty, defaults.max_tokens) == (1.1, 5)
    outputs = llm.generate([[5, 6, 7], [9]], use_tqdm=False)  # no SamplingParams: the model's
    assert [len(output.outputs[0].token_ids) for output in outputs] == [5, 5]
    explicit = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 3

    plain = LLM(model_with_generation_config, dtype="float32", num_device_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_a_directory_can_supply_the_generation_config(tiny_qwen2_dir, model_with_generation_config):
    llm = LLM(tiny_qwen2_dir, dtype="float32", num_device_blocks=64, generation_config=model_with_generation_config)
    assert llm.get_default_sampling_params().top_k == 20
    with pytest.raises(InvalidConfigError, match="generation_config"):
        LLM(tiny_qwen2_dir, generation_config="/no/such/directory")


def test_request_fields_override_the_defaults_and_unset_ones_take_them():
    defaults = dict(temperature=0.6, top_k=20, repetition_penalty=1.1, max_tokens=5)
    params = CompletionRequest(prompt="hi", temperature=0.2).completion_params(defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.2, 20, 1.1, 5)
    params = CompletionRequest(prompt="hi", max_tokens=9, top_k=-1).completion_params(defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, -1, 9)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling_params(None, 100, {}).max_tokens == 100  # no defaults: the server's own
    assert chat.sampling_params(None, 100, defaults).max_tokens == 5


def test_server_requests_without_max_tokens_take_the_models(model_with_generation_config):
    from support.live_server import LiveServer

    server = LiveServer(model=model_with_generation_config, num_device_blocks=64)
    try:
        def completion_tokens(**fields):
            body = {"prompt": [5, 6], "ignore_eos": True, **fields}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["completion_tokens"]

        assert completion_tokens() == 5
        assert completion_tokens(max_tokens=2) == 2
    finally:
        server.stop()
