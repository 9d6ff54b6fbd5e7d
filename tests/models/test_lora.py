"""LoRA adapters per request on the embedded SmolLM2 (float32, CPU): each request's greedy output
equals HF transformers running the base model with that adapter merged into its weights, with
requests of different adapters (and none) in the same batches, through chunked prefill,
preemption, prefix caching and forks; bad adapters are clear errors that leave nothing behind."""

import concurrent.futures
import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pagedkv import LLM, InvalidConfigError, LoRARequest, SamplingParams
from support.lora_adapters import HIDDEN, SHAPES, write_adapter

MAX_NEW_TOKENS = 20


def merged(hf_model, adapter_dir):
    """The HF model with the adapter's scale * B @ A added to each targeted weight."""
    from safetensors.torch import load_file

    config = json.loads(open(f"{adapter_dir}/adapter_config.json").read())
    scale = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    model = copy.deepcopy(hf_model)
    parameters = dict(model.named_parameters())
    weights = load_file(f"{adapter_dir}/adapter_model.safetensors")
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." in key:
                b = weights[key.replace(".lora_A.", ".lora_B.")]
                name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                parameters[name] += scale * (b @ a)
    return model


def hf_greedy(model, token_ids):
    with torch.inference_mode():
        out = model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
    return out[0, len(token_ids) :].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    every = write_adapter(root / "every", list(SHAPES), rank=8, alpha=16, seed=1)
    attention = write_adapter(root / "qv", ["q_proj", "v_proj"], rank=4, alpha=8, seed=2, use_rslora=True)
    return {"every": LoRARequest("every", 1, every), "qv": LoRARequest("qv", 2, attention)}


@pytest.fixture(scope="module")
def prompts(smollm2_hf_model):
    long_text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))
    return ["The quick brown fox", "def fibonacci(n):", long_text + " The last item is", "Paris is the capital of"]


@pytest.fixture(scope="module")
def references(smollm2_hf_model, smollm2_hf_tokenizer, adapters, prompts):
    """{adapter name or None: HF greedy tokens of every prompt}."""
    token_ids = [smollm2_hf_tokenizer.encode(prompt) for prompt in prompts]
    models = {None: smollm2_hf_model, **{key: merged(smollm2_hf_model, request.lora_path)
                                         for key, request in adapters.items()}}
    return {key: [hf_greedy(model, ids) for ids in token_ids] for key, model in models.items()}


def greedy(n=1):
    return SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, n=n)


def test_adapters_change_the_output(references):
    """(Otherwise the tests below could not tell an adapter from none.)"""
    assert references["every"] != references[None] and references["qv"] != references[None]
    assert references["every"] != references["qv"]


def test_mixed_adapters_in_one_batch_through_chunks_and_preemption(adapters, prompts, references):
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, num_device_blocks=40, max_num_batched_tokens=96,
              max_model_len=512, swap_space_bytes=64 << 20)
    keys = [None, "every", "qv"]
    jobs = [(prompt_index, key) for prompt_index in range(len(prompts)) for key in keys]
    outputs = llm.generate([prompts[i] for i, _ in jobs], greedy(), use_tqdm=False,
                           lora_request=[adapters[key] if key else None for _, key in jobs])
    for (prompt_index, key), output in zip(jobs, outputs):
        assert output.outputs[0].token_ids == references[key][prompt_index], (prompt_index, key)
    stats = llm.engine.stats()
    assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    assert {request.lora_name for request in llm.engine.list_loras()} == {"every", "qv"}


def test_prefix_cache_keeps_adapters_apart(adapters, prompts, references):
    """The same prompt cached by the base model (or another adapter) is not reused for an adapter:
    its K/V differ in every layer."""
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, num_device_blocks=256, max_model_len=512)
    long_prompt = prompts[2]
    for key in (None, "every", "qv", "every"):
        output = llm.generate([long_prompt], greedy(), use_tqdm=False, lora_request=adapters.get(key))[0]
        assert output.outputs[0].token_ids == references[key][2], key
    # The repeated adapter did hit its own cached prompt.
    assert output.metrics.num_prefix_hit_tokens > 0


def test_forked_samples_keep_their_adapter(adapters, prompts, references):
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, num_device_blocks=128, max_model_len=512)
    output = llm.generate([prompts[0]], greedy(n=2), use_tqdm=False, lora_request=adapters["every"])[0]
    assert [sample.token_ids for sample in output.outputs] == [references["every"][0]] * 2


def test_bad_adapters_are_clear_errors_and_queue_nothing(tmp_path, adapters):
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, max_lora_rank=8, num_device_blocks=64, max_model_len=256)
    too_big = write_adapter(tmp_path / "big", ["q_proj"], rank=16, alpha=16, seed=3)
    lm_head = write_adapter(tmp_path / "head", ["q_proj"], rank=4, alpha=4, seed=4,
                            extra_weights={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, HIDDEN)})
    dora = write_adapter(tmp_path / "dora", ["q_proj"], rank=4, alpha=4, seed=5, extra_config={"use_dora": True})
    pissa = write_adapter(tmp_path / "pissa", ["q_proj"], rank=4, alpha=4, seed=6,
                          extra_config={"init_lora_weights": "pissa"})
    saved = write_adapter(tmp_path / "saved", ["q_proj"], rank=4, alpha=4, seed=7,
                          extra_config={"modules_to_save": ["lm_head"]})
    cases = [
        (LoRARequest("big", 10, too_big), InvalidConfigError, "LoRA rank 16 is greater than max_lora_rank 8"),
        (LoRARequest("pissa", 14, pissa), InvalidConfigError, "init_lora_weights='pissa'.*base model's weights"),
        (LoRARequest("saved", 15, saved), InvalidConfigError, "Unsupported modules_to_save"),
        (LoRARequest("head", 11, lm_head), InvalidConfigError, "lm_head"),
        (LoRARequest("dora", 12, dora), InvalidConfigError, "does not yet support DoRA"),
        (LoRARequest("missing", 13, str(tmp_path / "nowhere")), InvalidConfigError, "adapter_config.json"),
        (LoRARequest("clash", adapters["every"].lora_int_id, adapters["qv"].lora_path), ValueError, "already names"),
        (LoRARequest("zero", 0, adapters["qv"].lora_path), ValueError, "lora_int_id"),
    ]
    llm.engine.add_lora(adapters["every"])
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            llm.generate(["Hello", "Hi"], greedy(), use_tqdm=False, lora_request=[None, request])
        assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]

    base = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="enable_lora=True"):
        base.generate(["Hello"], greedy(), use_tqdm=False, lora_request=adapters["qv"])
    with pytest.raises(InvalidConfigError, match="max_lora_rank"):
        LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, max_lora_rank=0)


def test_the_server_serves_each_adapter_as_a_model(adapters, references, prompts):
    import httpx

    from support.live_server import LiveServer

    from pagedkv.entrypoints.cli import parse_lora_module

    # (the adapters as `--lora-modules` gives them: vLLM's NAME=PATH and JSON forms)
    modules = dict([parse_lora_module(f"every={adapters['every'].lora_path}"),
                    parse_lora_module(json.dumps({"name": "qv", "path": adapters["qv"].lora_path,
                                                  "base_model_name": "smollm2-base"}))])
    live = LiveServer(enable_lora=True, gguf_weights="dequantized", num_device_blocks=128, max_model_len=256, lora_modules=modules)
    try:
        cards = httpx.get(live.url + "/v1/models", timeout=10).json()["data"]
        base = live.engine.model_name
        assert [(card["id"], card.get("parent"), card.get("root")) for card in cards][1:] == \
            [("every", base, adapters["every"].lora_path), ("qv", "smollm2-base", adapters["qv"].lora_path)]
        body = {"prompt": prompts[0], "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
        for model, key in ((base, None), ("every", "every")):
            response = httpx.post(live.url + "/v1/completions", json={**body, "model": model}, timeout=120).json()
            assert response["model"] == model
            expected = live.engine.tokenizer.decode(references[key][0], skip_special_tokens=True)
            assert response["choices"][0]["text"] == expected, model
        response = httpx.post(live.url + "/v1/completions", json={**body, "model": "nope"}, timeout=30)
        assert response.status_code == 404 and "'every'" in response.json()["error"]["message"]
    finally:
        live.stop()


def test_max_cpu_loras_drops_the_least_recently_used_adapter(adapters, prompts, references):
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, max_cpu_loras=1, num_device_blocks=128, max_model_len=512)
    for key in ("every", "qv", "every"):
        output = llm.generate([prompts[0]], greedy(), use_tqdm=False, lora_request=adapters[key])[0]
        assert output.outputs[0].token_ids == references[key][0], key
        assert [request.lora_name for request in llm.engine.list_loras()] == [key]
    # Both adapters in one batch with room for one: each request keeps its own loaded adapter.
    outputs = llm.generate([prompts[0], prompts[1]], greedy(), use_tqdm=False,
                           lora_request=[adapters["qv"], adapters["every"]])
    assert [output.outputs[0].token_ids for output in outputs] == [references["qv"][0], references["every"][1]]
    with pytest.raises(InvalidConfigError, match="max_cpu_loras"):
        LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, max_cpu_loras=0)


def test_the_server_loads_and_unloads_adapters_at_runtime(adapters, references, prompts, tmp_path):
    import httpx

    from support.live_server import LiveServer

    live = LiveServer(enable_lora=True, gguf_weights="dequantized", num_device_blocks=128, max_model_len=256, allow_runtime_lora_updating=True)
    try:
        def post(path, **body):
            return httpx.post(live.url + path, json=body, timeout=120)

        assert post("/v1/load_lora_adapter", lora_name="qv", lora_path=adapters["qv"].lora_path).status_code == 200
        again = post("/v1/load_lora_adapter", lora_name="qv", lora_path=adapters["qv"].lora_path)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        missing = post("/v1/load_lora_adapter", lora_name="gone", lora_path=str(tmp_path / "nowhere"))
        assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
        empty = tmp_path / "empty"
        empty.mkdir()
        incomplete = post("/v1/load_lora_adapter", lora_name="gone", lora_path=str(empty))
        assert incomplete.status_code == 400 and "adapter_config.json" in incomplete.json()["error"]["message"]
        damaged = tmp_path / "damaged"
        shutil.copytree(adapters["qv"].lora_path, damaged)
        (damaged / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
        corrupt = post("/v1/load_lora_adapter", lora_name="gone", lora_path=str(damaged))
        assert corrupt.status_code == 400 and corrupt.json()["error"]["param"] == "lora_path", corrupt.text
        (damaged / "adapter_config.json").write_text("{not json")
        corrupt = post("/v1/load_lora_adapter", lora_name="gone", lora_path=str(damaged))
        assert corrupt.status_code == 400 and "not readable JSON" in corrupt.json()["error"]["message"]
        assert [card["id"] for card in httpx.get(live.url + "/v1/models", timeout=10).json()["data"]][1:] == ["qv"]
        assert live.metric("pagedkv_lora_adapters_loaded") == 1
        body = {"prompt": prompts[0], "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "model": "qv"}
        text = post("/v1/completions", **body).json()["choices"][0]["text"]
        assert text == live.engine.tokenizer.decode(references["qv"][0], skip_special_tokens=True)
        assert post("/v1/unload_lora_adapter", lora_name="qv").status_code == 200
        assert post("/v1/completions", **body).status_code == 404
        assert post("/v1/unload_lora_adapter", lora_name="qv").status_code == 404
        assert live.engine.list_loras() == []

        # SageMaker's forms of the same routes.
        sagemaker = httpx.post(live.url + "/adapters", json={"name": "sm", "src": adapters["qv"].lora_path}, timeout=60)
        assert sagemaker.status_code == 200 and "sm" in [card["id"] for card in
                                                        httpx.get(live.url + "/v1/models", timeout=10).json()["data"]]
        missing = httpx.post(live.url + "/adapters", json={"name": "x", "src": str(tmp_path / "nowhere")}, timeout=60)
        assert missing.status_code == 404
        assert httpx.delete(live.url + "/adapters/sm", timeout=60).status_code == 200
        assert httpx.delete(live.url + "/adapters/sm", timeout=60).status_code == 404

        # Many loads at once (vLLM's test_multiple_lora_adapters): each its own id, each served;
        # the same name twice at once: one load.
        def load(name):
            return post("/v1/load_lora_adapter", lora_name=name, lora_path=adapters["qv"].lora_path).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(load, [f"a{i}" for i in range(6)] + ["twice", "twice"]))
        assert codes[:6] == [200] * 6 and sorted(codes[6:]) == [200, 400]
        ids = [adapter.lora_int_id for adapter in live.engine.list_loras()]
        assert len(ids) == len(set(ids)) == 7
        for name in ("a0", "a5", "twice"):
            text = post("/v1/completions", **{**body, "model": name}).json()["choices"][0]["text"]
            assert text == live.engine.tokenizer.decode(references["qv"][0], skip_special_tokens=True)
    finally:
        live.stop()
    closed = LiveServer(num_device_blocks=32, max_model_len=128)
    try:
        response = httpx.post(closed.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}, timeout=10)
        assert response.status_code == 404  # (the routes exist only when allowed)
    finally:
        closed.stop()


def test_stats_count_unfinished_requests_by_adapter(adapters):
    llm = LLM(dtype="float32", gguf_weights="dequantized", enable_lora=True, num_device_blocks=64, max_model_len=256)
    engine = llm.engine
    for index, lora in enumerate([adapters["every"], None, adapters["every"], adapters["qv"]]):
        engine.add_request(f"r{index}", "Hello there", greedy(), lora_request=lora)
    engine.step()
    stats = engine.stats()
    assert stats["lora_requests"] == {"every": 2, "qv": 1} and stats["num_loaded_loras"] == 2
    for index in range(4):
        engine.abort(f"r{index}")
    stats = engine.stats()
    assert stats["lora_requests"] == {} and stats["num_free_device_blocks"] == stats["num_device_blocks"]


def test_adapters_of_fused_projections_on_phi3(tmp_path):
    """Phi-3 holds q/k/v and gate/up fused, and so do its PEFT adapters (qkv_proj, gate_up_proj):
    greedy tokens equal HF with the adapter merged."""
    from support.checkpoints import save_tiny_checkpoint
    from support.tiny_models import tiny_phi3
    from transformers import AutoModelForCausalLM

    directory = save_tiny_checkpoint(tmp_path / "model", tiny_phi3())
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    shapes = {"self_attn.qkv_proj": (64, 64 + 2 * 32), "self_attn.o_proj": (64, 64), "mlp.gate_up_proj": (64, 256)}
    assert_adapter_gives_merged_hf_greedy(hf_model, directory, shapes, tmp_path / "adapter", seed=9)


def assert_adapter_gives_merged_hf_greedy(hf_model, model_dir: str, shapes: dict, adapter_dir, seed: int) -> None:
    """A rank-4 adapter of these modules ({PEFT module path: (in, out features)}) in each of 2
    layers: our greedy tokens with it equal HF's with it merged, and without it HF's plain ones."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for module, (in_features, out_features) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn((4, in_features), generator=generator) * 0.3
            weights[f"{prefix}.lora_B.weight"] = torch.randn((out_features, 4), generator=generator) * 0.3
    adapter_dir.mkdir()
    save_file(weights, str(adapter_dir / "adapter_model.safetensors"))
    (adapter_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))

    prompt = torch.randint(3, 256, (20,), generator=generator).tolist()
    llm = LLM(model_dir, dtype="float32", gguf_weights="dequantized", enable_lora=True, max_lora_rank=4, num_device_blocks=32)
    lora = LoRARequest("adapter", 1, str(adapter_dir))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    with_adapter = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    without = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    hf_model.generation_config.eos_token_id = None
    assert with_adapter == hf_greedy(merged(hf_model, str(adapter_dir)), prompt)
    assert without == hf_greedy(hf_model, prompt)
    assert with_adapter != without


UNGATED_MLP_ADAPTERS = {  # model -> the PEFT modules an adapter targets: (in, out features)
    "starcoder2": {"self_attn.q_proj": (128, 128), "self_attn.o_proj": (128, 128), "mlp.c_fc": (128, 192),
                   "mlp.c_proj": (192, 128)},
    "phi2": {"self_attn.q_proj": (160, 160), "self_attn.dense": (160, 160), "mlp.fc1": (160, 192),
             "mlp.fc2": (192, 160)},
}


@pytest.mark.parametrize("model_name", sorted(UNGATED_MLP_ADAPTERS))
def test_adapters_of_ungated_mlps(tmp_path, model_name):
    """StarCoder2's MLP is c_fc and c_proj, Phi-2's fc1 and fc2 (no gate), Phi-2's output
    projection `dense`: adapters of those and of attention give the greedy tokens of HF with the
    adapter merged."""
    from support.checkpoints import save_tiny_checkpoint
    from support.tiny_models import tiny_phi2, tiny_starcoder2

    hf_model = {"starcoder2": tiny_starcoder2, "phi2": tiny_phi2}[model_name]()
    save_tiny_checkpoint(tmp_path / "model", hf_model)
    assert_adapter_gives_merged_hf_greedy(hf_model, str(tmp_path / "model"), UNGATED_MLP_ADAPTERS[model_name],
                                          tmp_path / "adapter", seed=11)
