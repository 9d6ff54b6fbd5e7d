"""Request bodies of the OpenAI API (the fields pagedkv honours) and their mapping to SamplingParams.

Every nested part is described (messages and their content parts, tools, tool_choice,
response_format, structured outputs, Responses API input items), with OpenAI's types and no
coercion ("yes" is no boolean, 2.0 no integer, NaN no number), so malformed input is refused
with a 400 naming its field before any handler runs; the same models are the OpenAPI document.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator,
                      with_config)
from typing_extensions import TypedDict

from pagedkv.params.sampling import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROB_TOKEN_IDS, MAX_STOP_STRINGS, SamplingParams, check_unicode
from pagedkv.params.structured_output import StructuredOutputsParams


class RequestFieldError(Exception):
    """A request body holds a value no field may carry: text that is not valid Unicode (a lone
    surrogate) or a number that is not finite. `field` is the top-level field it is in; the
    message gives its whole path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_json_values(body: Any) -> None:
    """Raises RequestFieldError for the first string in a parsed JSON body that is not valid
    Unicode, or number that is not finite (JSON's NaN, Infinity, 1e999), wherever it is,
    free-form JSON (schemas, tool parameters) included. (Iterative: any depth of nesting; a
    path is spelled only for the value refused, so millions of token ids cost a fraction of a second.)"""
    pending = [(body, (), "")]  # (value, the keys and indices leading to it, the top-level field it is in)
    while pending:
        value, keys, field = pending.pop()
        if isinstance(value, str):
            try:
                check_unicode(value, _path(keys))
            except ValueError as error:
                raise RequestFieldError(field, str(error)) from None
        elif isinstance(value, float) and not math.isfinite(value):
            raise RequestFieldError(field, f"{_path(keys)} must be a finite number, got {value!r}")
        elif isinstance(value, dict):
            for key, item in value.items():
                try:
                    check_unicode(str(key), "key")
                except ValueError:
                    raise RequestFieldError(field or "body", f"{_path(keys)} has a key that is not valid Unicode") from None
                pending.append((item, (*keys, key), field or str(key)))
        elif isinstance(value, list):
            pending.extend((item, (*keys, index), field) for index, item in enumerate(value)
                           if type(item) is not int)  # (ints are always fine: skip token ids fast)


def _path(keys: tuple) -> str:
    return ".".join(map(str, keys)) or "body"


class _Part(BaseModel):
    """A part of a request body: OpenAI's types, strictly (no "yes" for true, no 2.0 for 2),
    finite numbers only; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Request(_Part):
    """A whole request body; see `check_json_values` for what is refused before its fields are read.
    TOKEN_ID_FIELDS: the fields that may hold prompts of token ids (a large body's are screened
    against max_model_len before it is parsed: server/body_screen.py)."""

    TOKEN_ID_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unencodable_values(cls, body: Any) -> Any:
        check_json_values(body)
        return body


# -- chat messages -----------------------------------------------------------------------------
class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(_Part):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(_Part):
    """Accepted for compatibility; pagedkv serves text models, which do not see it."""

    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(_Part):
    type: Literal["refusal"]
    refusal: str


class PromptEmbedsPart(_Part):
    """vLLM's: embeddings in place of text within a message, base64 of a torch.save'd tensor
    [length, hidden_size] (with --enable-prompt-embeds; server/prompt_embeds.py)."""

    type: Literal["prompt_embeds"]
    data: str


ContentPart = Annotated[Union[TextPart, ImagePart, RefusalPart, PromptEmbedsPart], Field(discriminator="type")]


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Part):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    """One chat turn; fields beyond these reach the chat template unchanged."""

    model_config = ConfigDict(extra="allow")

    # OpenAI's roles, or any other a chat template knows (vLLM's custom roles)
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # an assistant turn's reasoning, as text or (vLLM's) a prompt_embeds part
    reasoning: Optional[Union[str, PromptEmbedsPart]] = None

    def template_fields(self, embeds_marker: str = "") -> dict:
        """The message as chat templates read it: text content plus tool_calls, tool_call_id, ...;
        each prompt_embeds part as `embeds_marker`."""
        fields = {**self.model_dump(exclude_none=True), "content": self.text(embeds_marker)}
        if isinstance(self.reasoning, PromptEmbedsPart):
            fields["reasoning"] = embeds_marker
        return fields

    def text(self, embeds_marker: str = "") -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(part.text if isinstance(part, TextPart) else embeds_marker
                           for part in self.content if isinstance(part, (TextPart, PromptEmbedsPart)))
        return self.content or ""

    def embeds_parts(self) -> list[PromptEmbedsPart]:
        """The message's prompt_embeds parts in the order templates render them: its reasoning's,
        then its content's."""
        parts = [self.reasoning] if isinstance(self.reasoning, PromptEmbedsPart) else []
        return parts + ([part for part in self.content if isinstance(part, PromptEmbedsPart)] if isinstance(
            self.content, list) else [])


# -- tools -------------------------------------------------------------------------------------
class FunctionDefinition(_Part):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments
    strict: Optional[bool] = None


class ChatTool(_Part):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: FunctionName


# -- structured outputs ------------------------------------------------------------------------
class ResponseFormatText(_Part):
    type: Literal["text"]


class ResponseFormatJSONObject(_Part):
    type: Literal["json_object"]


class JSONSchemaFormat(_Part):
    model_config = ConfigDict(populate_by_name=True)

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormatJSONSchema(_Part):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[Union[ResponseFormatText, ResponseFormatJSONObject, ResponseFormatJSONSchema],
                           Field(discriminator="type")]


@with_config(ConfigDict(extra="forbid", strict=True, allow_inf_nan=False))
class StructuredOutputsBody(TypedDict, total=False):
    """vLLM's `structured_outputs`: exactly one of these (see StructuredOutputsParams)."""

    json: Union[str, dict[str, Any]]
    json_object: bool
    regex: str
    choice: list[str]
    grammar: str


class StreamOptions(_Part):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: with include_usage, usage so far in every chunk)


# The scheduler orders requests by a signed 64-bit priority (smaller first).
Priority = Annotated[int, Field(ge=-(2**63), lt=2**63)]


# -- completions and chat ----------------------------------------------------------------------
class RepetitionDetection(_Part):
    """vLLM's RepetitionDetectionParams (pagedkv.params.repetition checks the values)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class _Sampling(_Request):
    model: Optional[str] = None
    # vLLM's: the reply's id is "cmpl-" / "chatcmpl-" and this (a fresh one where not given)
    request_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1)
    best_of: Optional[int] = Field(default=None, ge=1)  # only n (every sample is returned)
    stop: Optional[Union[str, Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]]] = None
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)  # (vLLM's: a signed 64-bit integer)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id (as a string) -> bias in [-100, 100]
    logit_bias: Optional[Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extra sampling parameters (the openai client sends them through `extra_body`).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: Optional[Annotated[list[int], Field(max_length=MAX_STOP_STRINGS)]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: Optional[str] = None  # only requests with the same salt share prefix-cache blocks
    repetition_detection: Optional[RepetitionDetection] = None  # vLLM's: end a reply that repeats itself
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: Optional[Literal["left", "right"]] = None  # (vLLM's: the end truncate_prompt_tokens cuts)
    priority: Priority = 0  # with --scheduling-policy priority: smaller is served first
    prompt_logprobs: Optional[int] = Field(default=None, ge=-1)  # per prompt token: its logprob and k candidates (-1: all)
    return_token_ids: Optional[bool] = None  # the prompt's and each choice's token ids in the reply
    # vLLM's: these tokens' logprobs at each generated token (with the sampled one's) instead of the top k
    logprob_token_ids: Optional[Annotated[list[int], Field(max_length=MAX_LOGPROB_TOKEN_IDS)]] = None
    return_tokens_as_token_ids: Optional[bool] = None  # logprobs name tokens "token_id:<id>"
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _true_is_one(cls, prompt_logprobs):
        # (vLLM reads a JSON boolean here as its int, as its own tests send it: true asks for 1)
        return int(prompt_logprobs) if isinstance(prompt_logprobs, bool) else prompt_logprobs

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise RequestFieldError("stream_options", "stream_options can only be given with stream=true")
        return self

    @model_validator(mode="after")
    def _logprob_token_ids_apart_from_beams(self):
        if self.logprob_token_ids and self.use_beam_search:
            raise RequestFieldError("logprob_token_ids", "`logprob_token_ids` is not supported with beam search.")
        return self

    def reported_logprobs(self, top: Optional[int]) -> Optional[int]:
        """The logprobs candidates to ask the engine for (`top`, or 0 beside logprob_token_ids,
        which replace them); raises RequestFieldError for logprob_token_ids without logprobs."""
        if not self.logprob_token_ids:
            return top
        if top is None:
            wanted = "set to true" if isinstance(self, ChatCompletionRequest) else "set"
            raise RequestFieldError("logprob_token_ids", f"when using `logprob_token_ids`, `logprobs` must be {wanted}.")
        return 0

    def sampling_params(self, logprobs: Optional[int], default_max_tokens: int,
                        defaults: Optional[dict] = None) -> SamplingParams:
        """Fields the request leaves unset take `defaults` (the model's generation config: see
        LLMEngine.generation_defaults) where it has them. Raises ValueError naming the field
        (first word of the message) for invalid values."""
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n={self.n} (every sample is returned), got {self.best_of}")
        defaults = defaults or {}
        chosen = {name: value for name, value in defaults.items() if name not in self.model_fields_set}
        value = lambda name: chosen.get(name, getattr(self, name))  # noqa: E731
        max_tokens = self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens", default_max_tokens)
        return SamplingParams(
            n=self.n,
            temperature=value("temperature"),
            top_p=value("top_p"),
            top_k=value("top_k"),
            min_p=value("min_p"),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value("repetition_penalty"),
            logit_bias=self.token_logit_bias(),
            logprobs=self.reported_logprobs(logprobs),
            logprob_token_ids=self.logprob_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            structured_outputs=self.structured(),
            cache_salt=self.cache_salt,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            prompt_logprobs=self.prompt_logprobs,
            repetition_detection=self.repetition_detection.model_dump() if self.repetition_detection else None,
        )

    def structured(self) -> Optional[StructuredOutputsParams]:
        given = dict(self.structured_outputs or {})
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given[name] = value
        if isinstance(self.response_format, ResponseFormatJSONObject):
            given["json_object"] = True
        elif isinstance(self.response_format, ResponseFormatJSONSchema):
            if self.response_format.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            given["json"] = self.response_format.json_schema.schema_
        return StructuredOutputsParams(**given) if given else None

    def token_logit_bias(self) -> Optional[dict[int, float]]:
        if not self.logit_bias:
            return None
        try:
            return {int(token_id): bias for token_id, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias must be keyed by token ids, got {list(self.logit_bias)!r}") from None


# A prompt: text, token ids, or a batch of either. Token ids are tried first and the members in
# this order (pydantic's "smart" union tried every member on every element: 4 s for 2.8M ids).
PromptInput = Annotated[Union[list[int], str, list[str], list[list[int]]], Field(union_mode="left_to_right")]


NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."  # (vLLM's words)


class CompletionRequest(_Sampling):
    TOKEN_ID_FIELDS = ("prompt",)

    # vLLM's: prompts as embeddings, each base64 of a torch.save'd tensor [length, hidden_size]
    # (server/prompt_embeds.py); they come first, then `prompt`'s (an empty text prompt beside
    # them is dropped: clients send prompt="" because OpenAI's client requires one)
    prompt_embeds: Optional[Union[str, list[str]]] = None
    # One prompt (text or token ids) or a batch of them: choice i * n + j is sample j of prompt i.
    prompt: Optional[PromptInput] = Field(default=None, validate_default=True)
    logprobs: Optional[int] = Field(default=None, ge=-1)  # (at most the engine's max_logprobs; -1: the vocabulary)
    echo: bool = False  # prepend the prompt (and with logprobs, its tokens' logprobs) to each choice
    suffix: Optional[str] = None  # (OpenAI's insertion suffix: refused, as vLLM refuses it)
    add_special_tokens: bool = True  # (vLLM's: text prompts get the tokenizer's special tokens, a BOS)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix is not None:
            raise ValueError("suffix is not currently supported")
        return suffix

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, logprobs):
        # (a chat client's `logprobs: false` sent to completions, as SageMaker invocations do:
        # no logprobs; `true` names no count and stays an error)
        return None if logprobs is False else logprobs

    @field_validator("prompt")
    @classmethod
    def _given_unless_embeds_are(cls, prompt, info: ValidationInfo):
        if prompt is None and info.data.get("prompt_embeds") is None:
            raise ValueError(NO_PROMPT)
        return prompt

    def completion_params(self, defaults: Optional[dict] = None) -> SamplingParams:
        params = self.sampling_params(self.logprobs, 16, defaults)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # (as in vLLM: echo's logprobs start with the prompt's)
        return params

    def prompts(self) -> list[Union[str, list[int], dict]]:
        if self.prompt_embeds is None or self.prompt_embeds == []:
            if self.prompt is None:
                raise RequestFieldError("prompt", NO_PROMPT)
            return [self._tokenized_as_asked(prompt) for prompt in _prompt_list(self.prompt, "prompt")]
        from pagedkv.entrypoints.server.prompt_embeds import decode_prompt_embeds

        embedded = [{"prompt_embeds": tensor} for tensor in decode_prompt_embeds(self.prompt_embeds)]
        texts = [] if self.prompt in (None, "", [""]) else _prompt_list(self.prompt, "prompt")
        return embedded + [self._tokenized_as_asked(prompt) for prompt in texts]

    def _tokenized_as_asked(self, prompt):
        if isinstance(prompt, str) and not self.add_special_tokens:
            from pagedkv.engine.input_processor import text_prompt

            return text_prompt(prompt)
        return prompt


def _prompt_list(prompt, field: str) -> list[Union[str, list[int]]]:
    """One prompt (text or token ids) or a batch of them, as a list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError(f"{field} must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


# vLLM's (and OpenAI's) reasoning effort levels; "max" is DeepSeek V4's.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def template_kwargs(given: Optional[dict[str, Any]], reasoning_effort: Optional[str]) -> Optional[dict[str, Any]]:
    """The chat template's variables, as vLLM passes them: the request's chat_template_kwargs,
    and a reasoning effort as `reasoning_effort` plus, unless given, `enable_thinking` (false for
    "none": templates such as Qwen3's and Gemma 4's read it)."""
    if reasoning_effort is None:
        return given
    kwargs = dict(given or {})
    kwargs["reasoning_effort"] = reasoning_effort
    kwargs.setdefault("enable_thinking", reasoning_effort != "none")
    return kwargs


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=-1)  # (at most the engine's max_logprobs; -1: the vocabulary)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # template variables, e.g. {"enable_thinking": false}
    reasoning_effort: Optional[ReasoningEffort] = None  # a template variable too (`template_kwargs`)
    parallel_tool_calls: Optional[bool] = True  # false: only the first tool call is returned (vLLM's)
    return_prompt_text: Optional[bool] = None  # vLLM's: the rendered template in the reply (a stream's first chunks)
    # vLLM's: the most tokens a reply's think block may hold (-1: no limit; needs --reasoning-parser)
    thinking_token_budget: Optional[int] = None
    # vLLM's: the reply continues the last (assistant) message, or starts a new one; `echo` puts
    # that last assistant message's text before the reply's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: Optional[str] = None  # (vLLM's: the request's own, with --trust-request-chat-template)
    include_reasoning: bool = True  # (vLLM's: false leaves the reasoning parser's part out of the reply)
    add_special_tokens: bool = False  # (vLLM's: the tokenizer's BOS besides the template's own, if any)
    # vLLM's disaggregated-serving field; of it, only `prompt_token_ids` is read: a router forwards
    # the prefill stage's prompt ids, which then stand for the rendered messages.
    kv_transfer_params: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_way_to_start_the_reply(self):
        if self.thinking_token_budget is not None and self.thinking_token_budget < -1:
            raise RequestFieldError("thinking_token_budget", "`thinking_token_budget` must be a non-negative integer "
                                                             "or -1 (unlimited)")
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestFieldError("continue_final_message", "continue_final_message needs add_generation_prompt=false")
        return self

    def echoed_texts(self) -> list[str]:
        """With `echo`, each conversation's last message's text when it is the assistant's (what
        the reply continues), else ""."""
        return [conversation[-1].text() if self.echo and conversation[-1].role == "assistant" else ""
                for conversation in self.conversations()]

    def forwarded_prompt_token_ids(self, vocab_size: int) -> Optional[list[int]]:
        """kv_transfer_params.prompt_token_ids, checked (RequestFieldError), or None."""
        ids = (self.kv_transfer_params or {}).get("prompt_token_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or any(type(t) is not int for t in ids):
            raise RequestFieldError("kv_transfer_params", "kv_transfer_params.prompt_token_ids must be a non-empty "
                                                          "list of token ids")
        outside = sorted({t for t in ids if not 0 <= t < vocab_size})
        if outside:
            raise RequestFieldError("kv_transfer_params", f"token ids {outside[:5]} out of vocabulary [0, {vocab_size}) "
                                                          "in kv_transfer_params.prompt_token_ids")
        return ids

    def chat_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        return template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def conversations(self) -> list[list[ChatMessage]]:
        return [self.messages]

    def chat_tools(self) -> tuple[Optional[list[dict]], Optional[Union[str, dict]]]:
        """(tools, tool_choice) as the chat template and ToolCalling read them."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return tools, choice


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: the chat fields, with `messages` a list of conversations,
    each answered as a chat completion of its own; one response whose choice i * n + j is sample j
    of conversation i. Whole responses only (no `stream`)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)  # type: ignore[assignment]

    @model_validator(mode="after")
    def _not_streamed(self):
        if self.stream:
            raise RequestFieldError("stream", "stream: /v1/chat/completions/batch answers whole responses only")
        return self

    def conversations(self) -> list[list[ChatMessage]]:
        return self.messages


# -- pooling -----------------------------------------------------------------------------------

class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings: one input (text or token ids) or a batch of them."""

    TOKEN_ID_FIELDS = ("input",)

    model: Optional[str] = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    priority: Priority = 0

    def inputs(self) -> list[Union[str, list[int]]]:
        return _prompt_list(self.input, "input")


class ClassificationRequest(_Request):
    """vLLM's /classify: one input (text or token ids) or a batch of them."""

    TOKEN_ID_FIELDS = ("input",)

    model: Optional[str] = None
    input: PromptInput
    use_activation: bool = True  # False: the raw scores (a reward model's reward)
    user: Optional[str] = None
    priority: Priority = 0

    def inputs(self) -> list[Union[str, list[int]]]:
        return _prompt_list(self.input, "input")


class ScoreRequest(_Request):
    """vLLM's /score: `text_1` against each of `text_2`, or two lists pair by pair."""

    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    priority: Priority = 0


class RerankRequest(_Request):
    """vLLM's (Jina's, Cohere's) /rerank: the documents by their score against the query."""

    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: Optional[int] = Field(default=None, ge=0)  # None or 0: all of them
    priority: Priority = 0


# -- tokenizer and adapters --------------------------------------------------------------------
class TokenizeRequest(_Request):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    # (vLLM's defaults: true for a prompt, false for messages, whose rendered template holds its own)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # (with --trust-request-chat-template)
    return_token_strs: Optional[bool] = False  # the tokens' vocabulary strings too, as `token_strs`


class DetokenizeRequest(_Request):
    TOKEN_ID_FIELDS = ("tokens",)

    model: Optional[str] = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str


class SageMakerAdapterRequest(_Request):
    name: str
    src: str


# -- Responses API -----------------------------------------------------------------------------
class ResponseTextPart(_Part):
    type: Literal["input_text", "output_text"]
    text: str


class ResponseImagePart(_Part):
    """Accepted for compatibility; text models do not see it."""

    type: Literal["input_image"]
    image_url: Optional[str] = None


ResponseContentPart = Annotated[Union[ResponseTextPart, ResponseImagePart, RefusalPart],
                                Field(discriminator="type")]


class MessageItem(_Part):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: Union[str, list[ResponseContentPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, ResponseTextPart))


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    namespace: Optional[str] = None  # a namespaced tool's call: `name` is the tool's name in it


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Part):
    """Earlier reasoning, which is not shown to the model again."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> Optional[str]:
    """An input item's type; a message may leave it out (OpenAI's "easy input message")."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type),
]


class FunctionTool(_Part):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


# A namespace's tools reach the model as function tools named namespace + this + name, and their
# calls come back split (vLLM's, for Codex-style clients that group tools, e.g. an MCP server's).
NAMESPACE_SEPARATOR = "__"


def flat_tool_name(name: str, namespace: Optional[str]) -> str:
    """A tool's name as the model sees it: `namespace__name` for a namespace's tool."""
    return name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


class NamespaceTool(_Part):
    """OpenAI's Responses `namespace` tool: function tools grouped under one name."""

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    tools: list[FunctionTool] = Field(min_length=1)

    def flat_name(self, tool: FunctionTool) -> str:
        return flat_tool_name(tool.name, self.name)


ResponsesTool = Annotated[Union[FunctionTool, NamespaceTool], Field(discriminator="type")]


class ResponsesNamedToolChoice(_Part):
    type: Literal["function"]
    name: str


class ResponsesJSONSchemaFormat(JSONSchemaFormat):
    type: Literal["json_schema"]


class TextConfig(_Part):
    format: Annotated[Union[ResponseFormatText, ResponseFormatJSONObject, ResponsesJSONSchemaFormat],
                      Field(discriminator="type")] = Field(default_factory=lambda: ResponseFormatText(type="text"))


class ResponsesReasoning(_Part):
    """OpenAI's Responses `reasoning`: of it, `effort` is read (`summary` is accepted)."""

    effort: Optional[ReasoningEffort] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponsesRequest(_Sampling):
    """OpenAI's Responses API (/v1/responses): `instructions`, a stored previous response's turns
    and the `input` items become chat messages; flat function tools and `text.format` map to their
    chat equivalents."""

    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice]] = None
    text: Optional[TextConfig] = None
    previous_response_id: Optional[str] = None  # a stored response this one continues
    store: bool = True  # kept for GET /v1/responses/{id} and previous_response_id (server/responses_store.py)
    background: bool = False  # answered at once ("queued"), then read back by GET /v1/responses/{id}
    metadata: Optional[Annotated[dict[str, str], Field(max_length=16)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning: Optional[ResponsesReasoning] = None  # its effort is a template variable (`template_kwargs`)
    parallel_tool_calls: Optional[bool] = True  # false: only the first tool call is returned (vLLM's)
    # "message.output_text.logprobs" in `include`: each output_text part carries its tokens'
    # logprobs, with top_logprobs candidates each (vLLM's and OpenAI's)
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    enable_response_messages: bool = False  # (vLLM's: the prompt and reply as raw text and token ids)

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        return template_kwargs(self.chat_template_kwargs, self.reasoning.effort if self.reasoning else None)

    @property
    def includes_logprobs(self) -> bool:
        return bool(self.include) and "message.output_text.logprobs" in self.include

    def messages(self, history: list[ChatMessage] = ()) -> list[ChatMessage]:
        """The conversation as chat messages: instructions, `history` (a previous response's turns)
        and the input. Raises ValueError naming the field."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        turns += history
        input_turns = self.input_messages()
        if not turns + input_turns:
            raise ValueError("input must hold at least one message")
        return turns + input_turns

    def input_messages(self) -> list[ChatMessage]:
        """The input items as chat messages."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        turns = []
        for item in self.input:
            if isinstance(item, MessageItem):
                turns.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(id=item.call_id, function=FunctionCall(name=flat_tool_name(item.name, item.namespace),
                                                                       arguments=item.arguments))
                turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return turns

    def chat_tools(self) -> tuple[Optional[list[dict]], Optional[Union[str, dict]]]:
        """(tools, tool_choice) in the chat API's nested shape, namespaces flattened. A named
        choice may name a namespace's tool by its own name where only one namespace has it."""
        tools, in_namespaces = [], {}
        for tool in self.tools or []:
            for function in (tool.tools if isinstance(tool, NamespaceTool) else [tool]):
                name = tool.flat_name(function) if isinstance(tool, NamespaceTool) else function.name
                if isinstance(tool, NamespaceTool):
                    in_namespaces.setdefault(function.name, []).append(name)
                tools.append({"type": "function", "function": function.model_dump(
                    exclude_none=True, exclude={"type", "strict"}) | {"name": name}})
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedToolChoice):
            names = {tool["function"]["name"] for tool in tools}
            flat = in_namespaces.get(choice.name, [])
            name = flat[0] if choice.name not in names and len(flat) == 1 else choice.name
            choice = {"type": "function", "function": {"name": name}}
        return tools or None, choice

    def split_tool_name(self, name: str) -> tuple[Optional[str], str]:
        """(namespace, name) of a called tool's flat name; (None, name) for a plain tool's."""
        for tool in self.tools or []:
            for function in tool.tools if isinstance(tool, NamespaceTool) else []:
                if tool.flat_name(function) == name:
                    return tool.name, function.name
        return None, name

    def responses_params(self, default_max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
        if self.background and not self.store:
            raise ValueError("background can only be used when `store` is true (a background response is read "
                             "back from the store)")
        if self.background and self.stream:
            raise ValueError("background with stream is not supported: stream it, or poll a background response "
                             "with GET /v1/responses/{id}")
        if self.n != 1:
            raise ValueError(f"n must be 1 for responses, got {self.n}")
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, ResponsesJSONSchemaFormat):
            fmt = ResponseFormatJSONSchema(type="json_schema", json_schema=fmt)
        update = {"max_tokens": self.max_output_tokens, "response_format": fmt}
        logprobs = (self.top_logprobs or 0) if self.includes_logprobs else None
        return self.model_copy(update=update).sampling_params(logprobs, default_max_tokens, defaults)

    def echoed_fields(self) -> dict:
        """tools, tool_choice and text as a response repeats them (JSON-ready)."""
        given = self.model_dump(include={"tools", "tool_choice", "text"}, exclude_none=True, by_alias=True)
        return {"tools": given.get("tools", []), "tool_choice": given.get("tool_choice", "auto"),
                "text": given.get("text", {"format": {"type": "text"}}), "top_logprobs": self.top_logprobs or 0}
