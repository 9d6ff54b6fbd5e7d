"""What the engine, the server and the CLI know of the model: facts read once from the loaded
checkpoint, so nothing above the runner reaches into the model or its HF config."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    hidden_size: int
    max_model_len: int  # the limit the engine runs with (max_model_len, else the model's, capped)
    eos_token_ids: frozenset[int]
    num_parameters: int
    dtype: str  # of the weights, e.g. "bfloat16"
    attention_backend: str
    sliding_window: int  # every layer attends within this many positions; 0: some layer sees it all
    # Each KV-cache group's window (0: full), for models mixing layer kinds (runner/kv_groups.py); () with one group
    kv_group_windows: tuple[int, ...] = ()
    # A *ForSequenceClassification checkpoint's labels (it pools, it does not generate); 0 otherwise
    num_labels: int = 0
    class_labels: dict[int, str] = field(default_factory=dict)  # a classifier's id2label
    generation_defaults: dict = field(default_factory=dict)  # SamplingParams defaults from its generation config

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    def class_label(self, index: int) -> str:
        return self.class_labels.get(index, f"LABEL_{index}")
