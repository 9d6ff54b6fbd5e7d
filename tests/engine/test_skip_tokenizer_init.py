"""skip_tokenizer_init (vLLM's --skip-tokenizer-init): a checkpoint without a tokenizer serves token
ids in and out; whatever needs text is refused with vLLM's words."""

import os

import httpx
import pytest

from pagedkv import LLM, SamplingParams
from support.checkpoints import save_tiny_checkpoint
from support.tiny_models import tiny_llama

PROMPTS = [[1, 17, 42, 99, 5], [1, 200, 3]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(a tiny checkpoint with its tokenizer, the same weights without one)"""
    model = tiny_llama()
    full = save_tiny_checkpoint(tmp_path_factory.mktemp("full"), model)
    bare = tmp_path_factory.mktemp("bare")
    model.save_pretrained(bare, safe_serialization=True)
    assert not [name for name in os.listdir(bare) if name.startswith(("tokenizer", "special_tokens"))]
    return full, str(bare)


def test_token_ids_in_and_out_without_a_tokenizer(checkpoints):
    full, bare = checkpoints
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    with LLM(full, dtype="float32", num_device_blocks=32) as llm:
        want = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params, use_tqdm=False)]
    with pytest.raises(ValueError, match=r"has no tokenizer that loads(.|\n)*skip_tokenizer_init=True"):
        LLM(bare, dtype="float32", num_device_blocks=32)
    with LLM(bare, dtype="float32", num_device_blocks=32, skip_tokenizer_init=True) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == want
        assert all(output.outputs[0].text == "" and output.prompt is None for output in outputs)
        assert len(outputs[0].outputs[0].logprobs) == 8
        [beams] = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], beam_params(), use_tqdm=False)
        assert beams.sequences[0].tokens[:5] == PROMPTS[0] and beams.sequences[0].text == ""
        refused = {
            "You cannot pass text prompts when `skip_tokenizer_init=True`": ("hello", SamplingParams()),
            "stop strings .* need a tokenizer": (PROMPTS[0], SamplingParams(stop=["w7"])),
            "bad_words need a tokenizer": (PROMPTS[0], SamplingParams(bad_words=["w7"])),
            "structured outputs need a tokenizer": (PROMPTS[0], SamplingParams(structured_outputs={"regex": "w[0-9]"})),
        }
        for message, (prompt, refused_params) in refused.items():
            with pytest.raises(ValueError, match=message):
                llm.generate([prompt], refused_params, use_tqdm=False)
        with pytest.raises(ValueError, match="Tokenizer not available"):
            llm.chat([{"role": "user", "content": "hi"}])


def beam_params():
    from pagedkv import BeamSearchParams

    return BeamSearchParams(beam_width=2, max_tokens=4)


def test_a_server_without_a_tokenizer_takes_token_ids_and_refuses_text(checkpoints):
    from support.live_server import LiveServer

    _, bare = checkpoints
    live = LiveServer(model=bare, num_device_blocks=32, max_model_len=64, skip_tokenizer_init=True)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "echo": True, "return_token_ids": True,
                "logprobs": 1, "ignore_eos": True}
        choice = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 5 and choice["prompt_token_ids"] == PROMPTS[0]
        # (echo: the prompt's tokens first)
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in PROMPTS[0] + choice["token_ids"]]
        for route, request, message in [
            ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "You cannot pass text prompts"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "Tokenizer not available"),
            ("/tokenize", {"prompt": "hello"}, "Tokenizer not available"),
            ("/detokenize", {"tokens": [5, 6]}, "Tokenizer not available"),
        ]:
            response = httpx.post(live.url + route, json=request, timeout=60)
            assert response.status_code == 400 and message in response.text, (route, response.text)
    finally:
        live.stop()
