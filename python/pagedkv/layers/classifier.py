"""The head of a sequence-classification checkpoint (`*ForSequenceClassification`: classifiers,
reward models): a linear `score` layer over the final hidden state of the prompt's last token,
then the activation vLLM applies, which follows transformers' loss for the config's
`problem_type`: softmax over two or more labels, sigmoid over one label or for multi-label
problems, none for regression."""

from __future__ import annotations

import torch
from torch import nn


class SequenceClassifier(nn.Module):
    """`score` [num_labels, hidden] (and its bias, where the checkpoint has one)."""

    def __init__(self, hidden_size: int, num_labels: int, bias: bool, problem_type: str | None):
        super().__init__()
        self.score = nn.Linear(hidden_size, num_labels, bias=bias)
        self.problem_type = problem_type

    @property
    def num_labels(self) -> int:
        return self.score.out_features

    @torch.inference_mode()
    def forward(self, last_hidden: torch.Tensor, use_activation: bool = True) -> torch.Tensor:
        """float32 scores [num_labels] of one prompt from its last token's hidden state [hidden]."""
        scores = self.score(last_hidden).float()
        if not use_activation or self.problem_type == "regression":
            return scores
        if self.num_labels < 2 or self.problem_type == "multi_label_classification":
            return torch.sigmoid(scores)
        return torch.softmax(scores, dim=-1)
