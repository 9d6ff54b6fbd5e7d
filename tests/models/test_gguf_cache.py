"""A GGUF file is converted once into a cache entry (models/gguf_cache.py) that later loads read:
the entry holds what transformers reads from the file (its float32 weights once a load asks for
them), appears whole or not at all, follows the file's changes, and is made once when processes
load the same file together."""

import os
import threading

import pytest
import torch

from pagedkv.models import gguf_cache, loader


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDKV_GGUF_CACHE_MAX_BYTES", raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    calls = []

    def convert(path, directory):
        calls.append(path)
        (directory / "config.json").write_text(str(len(calls)))

    return str(gguf), convert, calls


def weights_writer(calls):
    def convert_weights(path, directory):
        calls.append(("weights", path))
        (directory / gguf_cache.WEIGHTS).write_text("float32")

    return convert_weights


def test_a_file_is_converted_once_and_again_when_it_changes(cache):
    path, convert, calls = cache
    first = gguf_cache.converted(path, convert=convert)
    assert gguf_cache.converted(path, convert=convert) == first and len(calls) == 1
    with open(path, "ab") as file:
        file.write(b"more")
    second = gguf_cache.converted(path, convert=convert)
    assert second != first and len(calls) == 2
    assert open(os.path.join(second, "config.json")).read() == "2"


def test_an_entry_left_incomplete_is_converted_again(cache):
    path, convert, calls = cache
    entry = gguf_cache.converted(path, convert=convert)
    os.remove(os.path.join(entry, gguf_cache.COMPLETE))  # (as a process killed mid-rename would leave it)
    assert gguf_cache.converted(path, convert=convert) == entry and len(calls) == 2


def test_a_failed_conversion_leaves_nothing(cache):
    path, convert, calls = cache

    def failing(path, directory):
        (directory / "config.json").write_text("half")
        raise RuntimeError("unreadable file")

    with pytest.raises(RuntimeError, match="unreadable"):
        gguf_cache.converted(path, convert=failing)
    root = gguf_cache.cache_root() / "gguf"
    assert [entry.name for entry in root.iterdir() if not entry.name.endswith(".lock")] == []
    assert gguf_cache.converted(path, convert=convert) is not None and len(calls) == 1


def test_weights_are_added_once_where_a_load_asks_for_them(cache):
    path, convert, calls = cache
    convert_weights = weights_writer(calls)
    entry = gguf_cache.converted(path, convert=convert, convert_weights=convert_weights)
    assert not os.path.exists(os.path.join(entry, gguf_cache.WEIGHTS)) and len(calls) == 1
    for _ in range(2):
        assert gguf_cache.converted(path, weights=True, convert=convert, convert_weights=convert_weights) == entry
    assert calls == [path, ("weights", path)]
    assert sorted(os.listdir(entry)) == sorted(["config.json", gguf_cache.COMPLETE, gguf_cache.WEIGHTS])


def test_a_failed_weights_conversion_leaves_the_entry_as_it_was(cache):
    path, convert, calls = cache

    def failing(path, directory):
        (directory / gguf_cache.WEIGHTS).write_text("half")
        raise RuntimeError("out of memory")

    entry = gguf_cache.converted(path, convert=convert)
    with pytest.raises(RuntimeError, match="out of memory"):
        gguf_cache.converted(path, weights=True, convert=convert, convert_weights=failing)
    assert sorted(os.listdir(entry)) == sorted(["config.json", gguf_cache.COMPLETE])


def test_weights_of_files_over_the_limit_and_a_limit_of_zero_are_not_cached(cache, monkeypatch):
    path, convert, calls = cache
    convert_weights = weights_writer(calls)
    monkeypatch.setenv("PAGEDKV_GGUF_CACHE_MAX_BYTES", str(os.path.getsize(path) - 1))
    assert gguf_cache.converted(path, weights=True, convert=convert, convert_weights=convert_weights) is None
    assert calls == []
    assert gguf_cache.converted(path, convert=convert) is not None and calls == [path]  # (the config and tokenizer)
    monkeypatch.setenv("PAGEDKV_GGUF_CACHE_MAX_BYTES", "0")
    assert gguf_cache.converted(path, convert=convert) is None


def test_loads_at_once_convert_once(cache):
    path, convert, calls = cache
    started = threading.Barrier(4)

    def slow(path, directory):
        convert(path, directory)
        threading.Event().wait(0.2)

    def load(results):
        started.wait()
        results.append(gguf_cache.converted(path, convert=slow))

    results = []
    threads = [threading.Thread(target=load, args=(results,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(calls) == 1


def test_the_embedded_models_entry_holds_what_transformers_reads(smollm2):
    """Whatever process made the entry, it equals transformers' own reading of the GGUF now:
    every weight (the tied LM head once), the config and the tokenizer. (The reference fixtures
    of the other tests read the entry: this test reads the GGUF itself.)"""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = smollm2
    smollm2_hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    smollm2_hf_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    entry, gguf = loader._readable(directory, name, weights=True)
    assert gguf is None and entry.startswith(str(gguf_cache.cache_root()))
    saved = load_file(os.path.join(entry, "model.safetensors"))
    expected = {k: v for k, v in smollm2_hf_model.state_dict().items() if k != "lm_head.weight"}
    assert saved.keys() == expected.keys()
    for weight_name, tensor in expected.items():
        assert torch.equal(saved[weight_name], tensor), weight_name

    # (transformers' model notes the GGUF it was read from as a quantization_config; its
    # AutoConfig, which the loader reads, has none)
    ignored = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"}
    config = {k: v for k, v in AutoConfig.from_pretrained(entry).to_dict().items() if k not in ignored}
    assert config == {k: v for k, v in smollm2_hf_model.config.to_dict().items() if k not in ignored}

    ours, theirs = AutoTokenizer.from_pretrained(entry), smollm2_hf_tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    return n", "naïve café, 東京 🙂 <|im_end|>"]
    assert [ours.encode(text) for text in texts] == [theirs.encode(text) for text in texts]
    chat = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


def test_a_cached_gguf_loads_without_reading_the_file(smollm2, monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def no_reading(*args, **kwargs):
        raise AssertionError("the GGUF file was read although the cache holds it")

    loader.model_spec(*smollm2)  # (converts here if no earlier test did)
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_reading)
    monkeypatch.setattr(gguf_cache, "convert_with_transformers", no_reading)
    spec = loader.model_spec(*smollm2)
    assert spec.hf_config.model_type == "llama" and spec.hf_config.num_attention_heads == 9
