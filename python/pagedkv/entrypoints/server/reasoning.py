"""Reasoning parsers (vLLM's `--reasoning-parser`): the `<think>...</think>` part of a chat reply
becomes the message's `reasoning_content` (also sent as `reasoning`, vLLM's newer name), the rest
its `content`.

- `deepseek_r1`: the chat template opens the think block in the prompt, so the reply is reasoning
  up to `</think>` (all of it when the reply never closes the block, e.g. cut off by max_tokens).
- `qwen3` (hybrid Qwen3 models, which open the block themselves): a reply is reasoning inside a
  think block it opens with `<think>`; with `chat_template_kwargs={"enable_thinking": false}`
  they write none, and the whole reply is content. A whole reply that only closes a block is
  split at `</think>` too, but streamed as content (nothing tells it apart until the close):
  templates that open the block in the prompt (QwQ, Qwen3-Thinking-2507) want `deepseek_r1`.
- `openai_gptoss` (GPT-OSS's harmony format): the reply is messages
  `<|channel|>NAME<|message|>TEXT<|end|>` (the next one after `<|start|>assistant`); the
  `analysis` channel's are reasoning, the `final` channel's and `commentary` preambles content.
  Harmony's markers are special tokens, so these replies are detokenized with them. A message to
  a recipient (`to=functions.NAME`: a tool call) stays in the content in its harmony form, header
  and all, where `--tool-call-parser openai` finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
START, END = "<think>", "</think>"
# Harmony's markers (GPT-OSS)
CHANNEL, MESSAGE, HARMONY_ENDS = "<|channel|>", "<|message|>", ("<|end|>", "<|return|>", "<|call|>")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag` (a tag maybe being written)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self):
        if self.name not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {self.name!r}")

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether replies must be detokenized with special tokens (harmony's markers are)."""
        return self.name == "openai_gptoss"

    def prompt_ends_reasoning(self, prompt_tail: str, thinking: bool = True) -> bool:
        """Whether a reply to this prompt (its last characters) starts past the reasoning, as
        vLLM's parsers tell it for structured outputs: deepseek_r1 when the prompt's last think tag
        closes a block; qwen3 the same within the current turn, and with neither tag there when
        thinking is off (chat_template_kwargs enable_thinking false); GPT-OSS always (its
        grammar is not held back)."""
        if self.name == "openai_gptoss":
            return True
        if self.name == "qwen3":
            prompt_tail = prompt_tail[max(prompt_tail.rfind(marker) for marker in TURN_BOUNDARIES) + 1:]
        opened, closed = prompt_tail.rfind(START), prompt_tail.rfind(END)
        if opened < 0 and closed < 0:
            return self.name == "qwen3" and not thinking
        return closed > opened

    def split(self, text: str, finished: bool = True) -> tuple[str, str]:
        """(reasoning, content) of a reply; of a growing one (`finished=False`), the parts that
        can be streamed so far: text that may still become a tag is held back."""
        if self.name == "openai_gptoss":
            return _split_harmony(text, finished)
        end = text.find(END)
        if end >= 0:
            return _without_start(text[:end]), text[end + len(END):]
        opened = text.startswith(START)
        if self.name == "qwen3" and not opened:
            if not finished and START.startswith(text):
                return "", ""  # "<thi..." may still open a block
            return "", text
        if not finished:
            if not opened and START.startswith(text):
                return "", ""
            reasoning = _without_start(text)
            return reasoning[: len(reasoning) - _partial_suffix(reasoning, END)], ""
        return _without_start(text), ""


# Where a ChatML prompt's turns begin and end (Qwen's templates): vLLM's qwen3 parser looks no
# further back than these for the current reply's think tags.
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


def _without_start(text: str) -> str:
    return text[len(START):] if text.startswith(START) else text


def _split_harmony(text: str, finished: bool) -> tuple[str, str]:
    """GPT-OSS's reply as (analysis messages, final messages and preambles), each joined by a
    newline; tool calls are content as written. A reply not in harmony form at all is content."""
    if MESSAGE not in text and not text.startswith("<|"):
        if not finished and text and "<|channel|>".startswith(text):
            return "", ""  # "<" may open a message
        return "", text
    reasoning, content = [], []
    position = 0
    while True:
        body_start = text.find(MESSAGE, position)
        if body_start < 0:
            break  # (a header still being written)
        header = text[position:body_start]
        body_start += len(MESSAGE)
        ends = [(index, marker) for marker in HARMONY_ENDS if (index := text.find(marker, body_start)) >= 0]
        if ends:
            body_end, marker = min(ends)
            body, position = text[body_start:body_end], body_end + len(marker)
        else:
            body = text[body_start:]
            if not finished:
                body = body[: len(body) - max(_partial_suffix(body, marker) for marker in HARMONY_ENDS)]
            position = len(text)
        channel_start = header.find(CHANNEL)
        channel = header[channel_start + len(CHANNEL):].strip() if channel_start >= 0 else ""
        if " to=" in header:
            content.append(header + MESSAGE + body)
        elif channel.startswith("analysis"):
            reasoning.append(body)
        else:
            content.append(body)
        if position >= len(text):
            break
    return "\n".join(reasoning), "\n".join(content)
