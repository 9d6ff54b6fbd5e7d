"""A rendered chat template holds its special tokens (Llama 3's <|begin_of_text|>, Gemma's <bos>):
chat prompts are tokenized without the tokenizer's own (no second BOS), as vLLM does, and text
prompts with them; `add_special_tokens` turns either way. Here the embedded model's tokenizer
is given a BOS (its <|endoftext|>) that its plain form does not add."""

import json
import shutil

import httpx
import pytest

from pagedkv.models import gguf_cache
from pagedkv.models.loader import default_model_path

BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    import os

    entry = gguf_cache.converted(os.path.join(*default_model_path()))
    directory = tmp_path_factory.mktemp("bos-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(entry, name)):
            shutil.copy(os.path.join(entry, name), directory / name)
    spec = json.loads((directory / "tokenizer.json").read_text())
    bos_id = next(token["id"] for token in spec["added_tokens"] if token["content"] == BOS)
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                                                                        {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}}}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return str(directory), bos_id


def test_chat_prompts_get_no_second_bos_and_text_prompts_keep_theirs(bos_tokenizer):
    from pagedkv import LLM, SamplingParams

    directory, bos_id = bos_tokenizer
    llm = LLM(tokenizer=directory, dtype="float32", num_device_blocks=32, max_model_len=256)
    try:
        tokenizer = llm.get_tokenizer()
        assert tokenizer.encode("Hi")[0] == bos_id  # (the tokenizer adds it)
        params = SamplingParams(max_tokens=1, temperature=0)
        [text] = llm.generate(["Hi"], params, use_tqdm=False)
        assert text.prompt_token_ids == tokenizer.encode("Hi")
        [chat] = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                 add_generation_prompt=True)
        assert chat.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
        assert chat.prompt_token_ids[0] != bos_id
    finally:
        llm.shutdown()


def test_the_server_follows_add_special_tokens(bos_tokenizer):
    from support.live_server import LiveServer

    directory, bos_id = bos_tokenizer
    live = LiveServer(tokenizer=directory, num_device_blocks=32, max_model_len=256)
    try:
        def prompt_ids(route: str, body: dict) -> list[int]:
            answer = httpx.post(live.url + route, timeout=60, json={"max_tokens": 1, "return_token_ids": True, **body})
            assert answer.status_code == 200, answer.text
            reply = answer.json()  # (chat names the prompt's ids beside its choices, completions in each)
            return reply.get("prompt_token_ids") or reply["choices"][0]["prompt_token_ids"]

        messages = [{"role": "user", "content": "Hi"}]
        assert prompt_ids("/v1/chat/completions", {"messages": messages})[0] != bos_id
        assert prompt_ids("/v1/chat/completions", {"messages": messages, "add_special_tokens": True})[0] == bos_id
        assert prompt_ids("/v1/completions", {"prompt": "Hi"})[0] == bos_id
        assert prompt_ids("/v1/completions", {"prompt": "Hi", "add_special_tokens": False})[0] != bos_id
        tokenized = httpx.post(live.url + "/tokenize", timeout=60, json={"messages": messages}).json()["tokens"]
        assert tokenized == prompt_ids("/v1/chat/completions", {"messages": messages})
        assert httpx.post(live.url + "/tokenize", timeout=60, json={"prompt": "Hi"}).json()["tokens"][0] == bos_id
    finally:
        live.stop()
