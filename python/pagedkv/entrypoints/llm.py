"""LLM: offline batched generation over the engine (the `vllm.LLM` shape)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedkv.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedkv.config import engine_config
from pagedkv.engine.input_processor import text_prompt
from pagedkv.engine.llm_engine import LLMEngine, prompt_of
from pagedkv.errors import OverloadedError
from pagedkv.params.lora_request import LoRARequest
from pagedkv.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedkv.params.pooling import PoolingParams
from pagedkv.entrypoints.scoring import score_pairs, scores_of, scoring_requests
from pagedkv.params.sampling import SamplingParams

Prompt = Union[str, list[int], dict]


class LLM:
    """Generate with a model served through the paged KV cache.

    `LLM()` loads the embedded SmolLM2-135M-Instruct; `LLM("path/to/hf_dir")` a local Llama-family
    checkpoint (config.json + safetensors) and `LLM(path, gguf_file=...)` a GGUF file. Other
    keyword arguments are `EngineConfig` fields (block_size, num_device_blocks, swap_space_bytes,
    preemption_mode, device, dtype, ...).
    """

    def __init__(self, model: Optional[str] = None, **engine_options):
        self.engine = LLMEngine(engine_config(model, engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks and frees its model and KV cache
        (idempotent). Leaving a `with LLM(...) as llm:` block, dropping the last reference to the
        LLM, or the interpreter's exit does the same; another LLM can start after it."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine underneath (vLLM's name for it)."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters `generate` uses when given none (vLLM's accessor): pagedkv's
        defaults, overridden by the model's generation config (EngineConfig.generation_config)."""
        return self.engine.get_default_sampling_params()

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's accessor); a ValueError with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        return self.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (continuous batching) and returns their outputs in
        prompt order. Prompts are strings, token-id lists or vLLM prompt dicts. `priority` (one per prompt, with
        scheduling_policy="priority"): smaller values are served first. `lora_request` (with
        enable_lora=True): one adapter for every prompt, or one (or None) per prompt."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        # Only finished outputs are used here: the engine need not detokenize every step.
        params_list = [dataclasses.replace(params, output_kind="final_only") for params in params_list]
        return self._run_to_completion(prompts, params_list, priority, use_tqdm, "generating", lora_request)

    def embed(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        pooling_params: Optional[PoolingParams] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (`output.outputs.embedding`, as in vLLM): the final
        hidden state of its last token, L2-normalized by default. Prompts are batched and
        prefix-cached like generation requests."""
        return self._pool(prompts, pooling_params or PoolingParams(), "embed", use_tqdm, priority, lora_request)

    def classify(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        pooling_params: Optional[PoolingParams] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[ClassificationRequestOutput]:
        """Every prompt's class probabilities (`output.outputs.probs`, as in vLLM) from a
        sequence-classification checkpoint (`*ForSequenceClassification`: classifiers and reward
        models): its score head over the last token's final hidden state, through softmax (sigmoid
        for one label); `PoolingParams(task="classify", use_activation=False)` gives the raw scores."""
        params = pooling_params or PoolingParams(task="classify")
        return self._pool(prompts, params, "classify", use_tqdm, priority, lora_request)

    def _pool(self, prompts, params: PoolingParams, task: str, use_tqdm: bool, priority, lora_request) -> list:
        if params.task != task:
            raise ValueError(f"LLM.{task} takes PoolingParams(task={task!r}), got task={params.task!r}")
        prompts = _as_prompt_list(prompts)
        return self._run_to_completion(prompts, [params] * len(prompts), priority, use_tqdm, task, lora_request)

    def score(
        self,
        text_1: Union[str, Sequence[str]],
        text_2: Union[str, Sequence[str]],
        use_tqdm: bool = True,
        lora_request: Optional[LoRARequest] = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's pair scores (`output.outputs.score`): `text_1` against each of `text_2`, or two
        lists of one length pair by pair. A cross-encoder (a sequence classifier of one label)
        scores each pair encoded together (its sigmoid); any other model scores the cosine
        similarity of the two texts' embeddings."""
        pairs = score_pairs(text_1, text_2)
        prompts, params = scoring_requests(pairs, self.get_tokenizer(), self.engine.model_info.num_labels)
        outputs = self._run_to_completion(prompts, [params] * len(prompts), None, use_tqdm, "scoring", lora_request)
        return [ScoringRequestOutput(f"score-{next(self._ids)}", ScoringOutput(score), token_ids)
                for score, token_ids in scores_of(pairs, prompts, outputs, params)]

    def _run_to_completion(self, prompts, params_list, priority, use_tqdm: bool, description: str,
                           lora_request=None) -> list:
        """Adds every request (as far as the waiting queue takes them), steps until all finish and
        returns their final outputs in prompt order."""
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.add_lora(lora)  # (a bad adapter fails here, before any request is queued)
        pending = [(f"llm-{next(self._ids)}", prompt, params, request_priority, lora)
                   for prompt, params, request_priority, lora in zip(prompts, params_list, priorities, loras)]
        order = {request_id: index for index, (request_id, *_) in enumerate(pending)}
        results: dict[str, RequestOutput] = {}
        engine = self.engine
        with tqdm(total=len(pending), desc=description, unit="req", disable=not use_tqdm) as progress:
            queue = list(reversed(pending))
            while queue or engine.has_unfinished_requests():
                # Feed the waiting queue up to its bound; the rest waits here (backpressure).
                while queue:
                    request_id, prompt, params, request_priority, lora = queue[-1]
                    try:
                        engine.add_request(request_id, prompt, params, priority=request_priority, lora_request=lora)
                    except OverloadedError:
                        break
                    queue.pop()
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        progress.update(1)
        return sorted(results.values(), key=lambda output: order[output.request_id])

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Optional[SamplingParams] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> list[RequestOutput]:
        """Applies the chat template (the tokenizer's, or `chat_template`, a Jinja template) to
        one conversation (or a list of them) and generates the assistant's reply.
        `chat_template_kwargs` are template variables (e.g. Qwen3's `enable_thinking`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            text_prompt(self.get_tokenizer().apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=True,
                **(chat_template_kwargs or {}),
            ))
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: Optional[LoRARequest] = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam-search API: each prompt's `beam_width` best beams, best first (scored by
        cumulative logprob / length ** length_penalty). Prompts are text, token ids, or vLLM's
        {"prompt": ...} / {"prompt_token_ids": ...} dicts. Beams share their prefix's blocks."""
        if params.temperature != 0:
            raise ValueError(f"temperature must be 0 for beam search (beams are greedy), got {params.temperature}")
        prompt_list = _as_prompt_list(prompts)
        sampling = SamplingParams(
            n=params.beam_width, use_beam_search=True, beam_width=params.beam_width, temperature=0.0,
            max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        outputs = self.generate(prompt_list, sampling, use_tqdm=use_tqdm, lora_request=lora_request)
        results = []
        for output in outputs:
            prompt_text = (output.prompt if output.prompt is not None
                           else self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else "")
            results.append(BeamSearchOutput([
                BeamSearchSequence(output.prompt_token_ids + beam.token_ids, prompt_text + beam.text,
                                   beam.cumulative_logprob, beam.finish_reason)
                for beam in output.outputs
            ]))
        return results

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's; see `LLMEngine.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (text, token ids or a vLLM prompt dict) or a sequence of them, as a list of
    texts and token-id lists (and text dicts that say how to tokenize them)."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    # (a text's "add_special_tokens" stays with it: the engine tokenizes it so)
    return [prompt if isinstance(prompt, dict) and "add_special_tokens" in prompt else prompt_of(prompt)
            for prompt in prompts]
