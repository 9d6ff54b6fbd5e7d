"""Request bodies of the OpenAI API (the fields pagedkv honours) and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.sampling_params import SamplingParams
from pagedkv.structured_output import StructuredOutputsParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias in [-100, 100]
    stream: bool = False
    stream_options: Optional[dict] = None
    user: Optional[str] = None
    # vLLM's extra sampling parameters (the openai client sends them through `extra_body`).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: Optional[str] = None  # only requests with the same salt share prefix-cache blocks
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    priority: int = 0  # with --scheduling-policy priority: smaller is served first
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields.
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def sampling_params(self, logprobs: Optional[int], default_max_tokens: int,
                        defaults: Optional[dict] = None) -> SamplingParams:
        """Fields the request leaves unset take `defaults` (the model's generation config: see
        LLMEngine.generation_defaults) where it has them. Raises ValueError naming the field
        (first word of the message) for invalid values."""
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
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            structured_outputs=self.structured(),
            cache_salt=self.cache_salt,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    def structured(self) -> Optional[StructuredOutputsParams]:
        given = dict(self.structured_outputs or {})
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given[name] = value
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            given["json_object"] = True
        elif kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            given["json"] = schema
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        if not given:
            return None
        try:
            return StructuredOutputsParams(**given)
        except TypeError:
            raise ValueError(f"structured_outputs has unknown fields: {sorted(given)}") from None

    def token_logit_bias(self) -> Optional[dict[int, float]]:
        if not self.logit_bias:
            return None
        try:
            return {int(token_id): bias for token_id, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias must be keyed by token ids, got {list(self.logit_bias)!r}") from None


class CompletionRequest(_Sampling):
    # One prompt (text or token ids) or a batch of them: choice i * n + j is sample j of prompt i.
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False  # prepend the prompt (and with logprobs, its tokens' logprobs) to each choice

    def completion_params(self, defaults: Optional[dict] = None) -> SamplingParams:
        params = self.sampling_params(self.logprobs, 16, defaults)
        if self.echo and self.logprobs is not None:  # as in vLLM: the prompt's logprobs come first
            params.prompt_logprobs = self.logprobs
        return params

    def prompts(self) -> list[Union[str, list[int]]]:
        return _prompt_list(self.prompt, "prompt")


def _prompt_list(prompt, field: str) -> list[Union[str, list[int]]]:
    """One prompt (text or token ids) or a batch of them, as a list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError(f"{field} must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings: one input (text or token ids) or a batch of them."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    priority: int = 0

    def inputs(self) -> list[Union[str, list[int]]]:
        return _prompt_list(self.input, "input")


class ClassificationRequest(BaseModel):
    """vLLM's /classify: one input (text or token ids) or a batch of them."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    use_activation: bool = True  # False: the raw scores (a reward model's reward)
    user: Optional[str] = None
    priority: int = 0

    def inputs(self) -> list[Union[str, list[int]]]:
        return _prompt_list(self.input, "input")


class ScoreRequest(BaseModel):
    """vLLM's /score: `text_1` against each of `text_2`, or two lists pair by pair."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    priority: int = 0


class RerankRequest(BaseModel):
    """vLLM's (Jina's, Cohere's) /rerank: the documents by their score against the query."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: Optional[int] = Field(default=None, ge=0)  # None or 0: all of them
    priority: int = 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict]]] = None

    def template_fields(self) -> dict:
        """The message as chat templates read it: text content plus tool_calls, tool_call_id, ..."""
        return {**(self.model_extra or {}), "role": self.role, "content": self.text()}

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    chat_template_kwargs: Optional[dict] = None  # template variables, e.g. {"enable_thinking": false}

    def chat_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict] = None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


class ResponsesRequest(_Sampling):
    """OpenAI's Responses API (/v1/responses), stateless: `instructions` and the `input` items
    become chat messages; flat function tools and `text.format` map to their chat equivalents."""

    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    text: Optional[dict] = None  # {"format": {"type": "text" | "json_object" | "json_schema", "schema": ...}}
    previous_response_id: Optional[str] = None
    metadata: Optional[dict] = None
    chat_template_kwargs: Optional[dict] = None

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages. Raises ValueError naming the field."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return turns + [ChatMessage(role="user", content=self.input)]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                content = item.get("content")
                if isinstance(content, list):  # input_text / output_text parts
                    content = "".join(part.get("text", "") for part in content if "text" in part)
                try:
                    turns.append(ChatMessage(role=item.get("role", "user"), content=content))
                except ValueError:
                    raise ValueError(f"input message role must be system, developer, user or assistant, got "
                                     f"{item.get('role')!r}") from None
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif kind == "function_call_output":
                turns.append(ChatMessage(role="tool", content=str(item.get("output", "")),
                                         tool_call_id=item.get("call_id")))
            elif kind != "reasoning":  # earlier reasoning is not shown to the model again
                raise ValueError(f"input item type {kind!r} is not supported (message, function_call, "
                                 "function_call_output, reasoning)")
        if not turns:
            raise ValueError("input must hold at least one message")
        return turns

    def chat_tools(self) -> tuple[Optional[list[dict]], Optional[Union[str, dict]]]:
        """(tools, tool_choice) in the chat API's nested shape."""
        tools = []
        for tool in self.tools or []:
            if tool.get("type") != "function" or not tool.get("name"):
                raise ValueError(f"tools must be function tools (the only kind supported), got {tool!r}")
            function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
            tools.append({"type": "function", "function": function})
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        return tools or None, choice

    def responses_params(self, default_max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: responses are not stored; send the "
                             "conversation in input")
        if self.n != 1:
            raise ValueError(f"n must be 1 for responses, got {self.n}")
        fmt = dict((self.text or {}).get("format") or {"type": "text"})
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema"), "name": fmt.get("name")}}
        update = {"max_tokens": self.max_output_tokens, "response_format": fmt}
        return self.model_copy(update=update).sampling_params(None, default_max_tokens, defaults)
