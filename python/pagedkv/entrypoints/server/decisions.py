"""OpenAI's Decisions API as vLLM serves it (/v1/decisions): questions about a text, each answered
with probabilities read from the model's next token.

Each question becomes one chat prompt: the input text, then the question with its options labeled
A, B, C... and "Answer with the letter of one option only."; the reply's first token is not
sampled but read: the logprobs of the labels' tokens there (`logprob_token_ids`), softmaxed over
the labels. A predicate is a choice between "false" and "true"; a score's levels are its options
and its score the expected level (0-based). The questions share the input text, so with prefix
caching it is prefilled once.
"""

from __future__ import annotations

import json
import math
import string
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

LABELS = tuple(string.ascii_uppercase)  # (one token each at the start of a reply, checked per tokenizer)
MAX_QUESTIONS = 64
ShortText = Annotated[StrictStr, Field(max_length=1 << 20)]
InputText = Annotated[StrictStr, Field(max_length=10 << 20)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class InputTextPart(_Part):
    type: Literal["input_text"]
    text: InputText


class InputMessage(_Part):
    role: Literal["user"]
    content: Union[InputText, Annotated[list[InputTextPart], Field(max_length=16384)]]
    type: Literal["message"] = "message"

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list) and any(
                isinstance(part, dict) and part.get("type") == "input_image" for part in data["content"]):
            raise ValueError("Decisions supports text input only; images are not supported")
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class _Question(_Part):
    instructions: ShortText
    name: Optional[ShortText] = None

    @model_validator(mode="after")
    def _named_by_a_string(self):
        if "name" in self.model_fields_set and self.name is None:
            raise ValueError("name must be a string when provided")
        return self


class PredicateQuestion(_Question):
    type: Literal["predicate"]

    def options(self) -> list[tuple[str, str]]:
        return [("false", ""), ("true", "")]

    def answer(self, probs: list[float], mass: float) -> dict:
        return {"type": "predicate", "name": self.name, "probability": probs[1]}


class ChoiceOption(_Part):
    value: Union[StrictStr, StrictBool]
    description: ShortText = ""


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=len(LABELS))

    @model_validator(mode="after")
    def _distinct(self):
        values = [(type(choice.value), choice.value) for choice in self.choices]
        if len(set(values)) != len(values):
            raise ValueError("choice values must be distinct")
        return self

    def options(self) -> list[tuple[str, str]]:
        return [(json.dumps(choice.value, ensure_ascii=False), choice.description) for choice in self.choices]

    def answer(self, probs: list[float], mass: float) -> dict:
        top = max(range(len(probs)), key=probs.__getitem__)
        return {"type": "choice", "name": self.name, "choice": self.choices[top].value,
                "probabilities": [{"value": choice.value, "probability": p} for choice, p in zip(self.choices, probs)],
                "confidence": probs[top] * mass}


class ScoreLevel(_Part):
    label: ShortText
    description: ShortText = ""


class ScoreQuestion(_Question):
    type: Literal["score"]
    levels: list[ScoreLevel] = Field(min_length=2, max_length=10)

    def options(self) -> list[tuple[str, str]]:
        return [(level.label, level.description) for level in self.levels]

    def answer(self, probs: list[float], mass: float) -> dict:
        top = max(range(len(probs)), key=probs.__getitem__)
        return {"type": "score", "name": self.name, "score": sum(i * p for i, p in enumerate(probs)),
                "probabilities": [{"value": i, "label": level.label, "probability": p}
                                  for i, (level, p) in enumerate(zip(self.levels, probs))],
                "confidence": probs[top] * mass}


Question = Annotated[Union[PredicateQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class DecisionRequest(_Part):
    model: Optional[ShortText] = None
    input: Union[InputText, Annotated[list[InputMessage], Field(max_length=131072)]]
    questions: list[Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    safety_identifier: Optional[Annotated[StrictStr, Field(max_length=128)]] = None
    cache_salt: Optional[Annotated[StrictStr, Field(min_length=1, max_length=1024)]] = None
    joint: StrictBool = False  # (vLLM's: joint reads, for diffusion models only)

    def text(self) -> str:
        return self.input if isinstance(self.input, str) else "\n\n".join(message.text() for message in self.input)


def question_prompt(text: str, question) -> str:
    """The user turn that asks `question` about `text`."""
    lines = [f"{label}: {name} - {description}" if description else f"{label}: {name}"
             for label, (name, description) in zip(LABELS, question.options())]
    return f"{text}\n\nQuestion: {question.instructions}\n" + "\n".join(lines) + \
        "\nAnswer with the letter of one option only."


def label_token_ids(tokenizer, generation_prompt_ids: list[int]) -> list[int]:
    """Each label's token as the first token of a reply after `generation_prompt_ids` (a chat
    prompt's, up to its generation prompt). Raises ValueError if a label is not one distinct token
    there (the tokenizer cannot be read this way)."""
    added = set(tokenizer.get_added_vocab().values())
    start = max((i + 1 for i, token in enumerate(generation_prompt_ids) if token in added), default=0)
    tail = list(generation_prompt_ids[start:])
    tail_text = tokenizer.decode(tail)
    ids: list[int] = []
    for label in LABELS:
        extended = tokenizer.encode(tail_text + label, add_special_tokens=False)
        if extended[:-1] != tail or extended[-1] in ids:
            raise ValueError(f"label {label!r} is not one distinct token after this model's chat prompt")
        ids.append(extended[-1])
    return ids


def read_answer(question, logprobs: dict[int, float], label_ids: list[int]) -> dict:
    """The answer to `question` from its read: the labels' logprobs softmaxed over its options;
    confidence is the chosen label's probability over the whole vocabulary."""
    values = [logprobs[token] for token in label_ids[:len(question.options())]]
    top = max(values)
    weights = [math.exp(value - top) for value in values]
    total = sum(weights)
    return question.answer([w / total for w in weights], sum(math.exp(value) for value in values))
