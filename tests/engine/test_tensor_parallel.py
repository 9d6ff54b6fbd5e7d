"""Tensor parallelism on the CPU (gloo): a model sharded over 2 or 3 processes generates what the
unsharded one does, token for token, through every scheduler feature; bad configurations are
clear errors; a lost rank stops the engine (and the server) with an error, in bounded time,
leaving no process behind."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.beam_search import BeamSearchParams
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import InvalidConfigError, TensorParallelError

from support.checkpoints import save_tiny_checkpoint
from support.live_server import served
from support.tiny_models import save_biased_tiny_llama


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return save_biased_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tp"))


PROMPTS = [[5, 6, 7, 8, 9] * 3, [10, 11, 12] * 9, [30 + i for i in range(40)], [5, 6, 7, 8, 9] * 3 + [77, 78]]


def generations(model_dir: str, tensor_parallel_size: int, **options) -> list:
    """Greedy and sampled (n=3, seeded) generations and a beam search over PROMPTS."""
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tensor_parallel_size, **options)
    try:
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=12, temperature=0.8, n=3, seed=7, ignore_eos=True)
        prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
        outputs = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, greedy)]
        outputs += [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, sampled)]
        beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
        outputs += [[list(s.tokens) for s in o.sequences] for o in beams]
        stats = llm.engine.stats()
        return outputs, stats
    finally:
        llm.shutdown()


SETTINGS = {
    "roomy": dict(num_device_blocks=256),
    "chunked-no-prefix-cache": dict(num_device_blocks=256, max_num_batched_tokens=16, enable_prefix_caching=False),
    "swap": dict(num_device_blocks=14, preemption_mode="swap", max_num_batched_tokens=64),
    "recompute": dict(num_device_blocks=14, preemption_mode="recompute", max_num_batched_tokens=64),
}


# Both tiny models in the roomy pool; one each under the other settings (each engine with ranks
# costs seconds of start-up): Qwen2's qkv bias through chunks and recompute, Llama through swaps.
MODELS = {"roomy": ("llama", "qwen2"), "chunked-no-prefix-cache": ("qwen2",), "swap": ("llama",),
          "recompute": ("qwen2",)}


@pytest.mark.parametrize("setting", SETTINGS)
def test_two_ranks_generate_what_one_does(tiny_llama_dir, tiny_qwen2_dir, setting):
    directories = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}
    for model_dir in (directories[model] for model in MODELS[setting]):
        expected, _ = generations(model_dir, 1, **SETTINGS[setting])
        got, stats = generations(model_dir, 2, **SETTINGS[setting])
        assert got == expected, model_dir
        if setting in ("swap", "recompute"):
            assert stats[f"num_preemptions_{setting}"] > 0, "the pool was meant to preempt"


def test_three_ranks_on_smollm2_generate_what_one_does():
    """SmolLM2-135M: 9 query / 3 KV heads, tied embeddings; each rank holds a third of them."""
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    texts = {}
    for size in (1, 3):
        llm = LLM(dtype="float32", tensor_parallel_size=size, num_device_blocks=64, max_model_len=256)
        try:
            texts[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if size == 3:
                attention = llm.engine.runner.model.layers[0].self_attn
                assert (attention.num_heads, attention.num_kv_heads) == (3, 1)
        finally:
            llm.shutdown()
    assert texts[3] == texts[1]


def test_a_rank_holds_its_shard_of_the_weights_and_of_the_kv_cache(tiny_llama_dir):
    threads = torch.get_num_threads()
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2, num_device_blocks=32)
    try:
        assert torch.get_num_threads() == max(1, os.cpu_count() // 2)  # (the ranks share the cores)
        runner = llm.engine.runner
        layer = runner.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.shape == ((2 + 2 * 1) * 16, 64)  # 2 query, 1 KV head of 16 dims
        assert layer.mlp.down_proj.weight.shape == (64, 48)
        assert runner.kv_cache.device_cache.shape[3] == 1  # [blocks, layers, 2, KV heads, block size, head dim]
        assert runner.num_device_blocks == 32
    finally:
        llm.shutdown()
    assert torch.get_num_threads() == threads
    assert_no_worker_left()


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 must divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=2, enable_lora=True), "LoRA adapters do not shard yet"),
    (dict(tensor_parallel_size=2, device="cuda"), "needs 2 GPUs"),
])
def test_configurations_that_cannot_shard_are_clear_errors(tiny_llama_dir, options, message):
    if "device" in options and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(InvalidConfigError, match=message):
        LLM(tiny_llama_dir, dtype="float32", num_device_blocks=32, **options)
    assert_no_worker_left()


def test_mixture_of_experts_models_are_refused_clearly(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model_dir = save_tiny_checkpoint(tmp_path, Qwen2MoeForCausalLM(config))
    with pytest.raises(InvalidConfigError, match="mixture-of-experts models .* do not shard yet"):
        LLM(model_dir, dtype="float32", tensor_parallel_size=2, num_device_blocks=32)


def test_a_hung_rank_fails_the_step_within_the_timeout_and_a_dead_one_at_once(tiny_llama_dir):
    engine = LLMEngine(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2, num_device_blocks=32,
                       distributed_timeout_seconds=3.0)
    [worker] = worker_pids()
    try:
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(worker, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TensorParallelError):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < 30
        with pytest.raises(TensorParallelError):  # for good
            engine.step()
    finally:
        os.kill(worker, signal.SIGKILL)
        engine.shutdown()
    assert_no_worker_left()


def test_the_server_answers_with_two_ranks_and_exits_nonzero_when_one_dies(tiny_llama_dir):
    import openai

    with served("--model", tiny_llama_dir, "--tensor-parallel-size", "2", "--dtype", "float32",
                "--distributed-timeout-seconds", "10") as (url, process, output):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        completion = client.completions.create(model=client.models.list().data[0].id, prompt="w5 w6 w7", max_tokens=4)
        assert completion.usage.completion_tokens == 4
        [worker] = worker_pids(process.pid)
        stream = httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": "w5 w6", "max_tokens": 400, "ignore_eos": True, "stream": True})
        with stream as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(worker, signal.SIGKILL)
            rest = list(lines)
        events = [line for line in rest if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "the engine stopped" in events[-2], events[-3:]
        assert process.wait(timeout=60) != 0
        output.seek(0)
        log = output.read()
    assert "the server stopped because the engine failed" in log, log[-3000:]
    assert_no_worker_left()


def worker_pids(parent: int = os.getpid()) -> list[int]:
    """Processes running pagedkv's tensor-parallel ranks whose parent is `parent`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                command = cmdline.read()
        except OSError:
            continue
        if ppid == parent and b"pagedkv.parallel.workers" in command:
            pids.append(int(entry))
    return pids


def assert_no_worker_left(seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while any_worker_running():
        assert time.monotonic() < deadline, "a tensor-parallel worker outlived its engine"
        time.sleep(0.1)


def any_worker_running() -> bool:
    """A rank of this test session (under pytest-xdist: this worker's) still running."""
    session = f"PYTEST_XDIST_WORKER={os.environ.get('PYTEST_XDIST_WORKER', '')}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    command = cmdline.read()
                with open(f"/proc/{entry}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/{entry}/environ", "rb") as environ:  # (inherited by the ranks)
                    ours = "PYTEST_XDIST_WORKER" not in os.environ or session in environ.read().split(b"\0")
            except OSError:
                continue
            if b"pagedkv.parallel.workers" in command and state != "Z" and ours:
                return True
    return False


def test_torchrun_launches_the_same_engine(tiny_llama_dir, tmp_path):
    """Multi-node's code path on one node: every rank runs the script; rank 0 generates."""
    script = tmp_path / "generate.py"
    script.write_text(
        "import sys\n"
        "from pagedkv import LLM, SamplingParams\n"
        f"llm = LLM({tiny_llama_dir!r}, dtype='float32', tensor_parallel_size=2, num_device_blocks=32)\n"
        "out = llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}], SamplingParams(max_tokens=8, temperature=0))\n"
        "print('TOKENS', list(out[0].outputs[0].token_ids))\n"
        "llm.shutdown()\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    llm = LLM(tiny_llama_dir, dtype="float32", num_device_blocks=32)
    expected = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=8, temperature=0))
    assert lines == [f"TOKENS {list(expected[0].outputs[0].token_ids)}"]


def test_workers_exit_when_rank_0_is_killed(tiny_llama_dir, tmp_path):
    """SIGKILL leaves rank 0 no time to stop its workers: they notice its exit themselves."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import time\n"
        "from pagedkv import LLM\n"
        f"llm = LLM({tiny_llama_dir!r}, dtype='float32', tensor_parallel_size=2, num_device_blocks=32)\n"
        "print('READY', flush=True)\n"
        "time.sleep(600)\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "READY"
        [worker] = worker_pids(process.pid)
        process.kill()
        process.wait(10)
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{worker}") and not _is_zombie(worker):
            assert time.monotonic() < deadline, "the worker outlived a killed rank 0"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_each_rank_reads_its_slices_of_a_safetensors_file(tiny_llama_dir):
    """The slices a rank reads from the file (without loading the rest) are its shard of the
    tensors, and the ranks' shards together are the whole tensors."""
    import glob

    from safetensors import safe_open
    from transformers import AutoConfig

    from pagedkv.parallel.group import TensorParallelGroup
    from pagedkv.parallel.sharding import CheckpointShard

    hf_config = AutoConfig.from_pretrained(tiny_llama_dir)
    shards = [CheckpointShard(hf_config, TensorParallelGroup(rank=rank, size=2)) for rank in range(2)]
    [path] = glob.glob(os.path.join(tiny_llama_dir, "*.safetensors"))
    with safe_open(path, framework="pt") as checkpoint:
        for name in checkpoint.keys():
            whole = checkpoint.get_tensor(name)
            parts = [shard.take(name, checkpoint.get_slice(name)) for shard in shards]
            for shard, part in zip(shards, parts):
                assert torch.equal(part, shard.take(name, whole)), name
            kind = name.rsplit(".", 2)[-2]
            if kind in ("q_proj", "gate_proj", "up_proj"):
                assert torch.equal(torch.cat(parts, dim=0), whole), name
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert torch.equal(torch.cat(parts, dim=1), whole), name
            elif kind in ("k_proj", "v_proj"):  # (2 KV heads over 2 ranks: one each)
                assert torch.equal(torch.cat(parts, dim=0), whole) and parts[0].shape[0] == 16, name
            elif name.endswith(("o_proj.bias", "down_proj.bias")):
                assert torch.equal(parts[0], whole) and not parts[1].any(), name
            else:
                assert all(torch.equal(part, whole) for part in parts), name
