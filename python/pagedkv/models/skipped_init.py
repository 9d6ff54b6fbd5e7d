"""Building a model without drawing its random initial weights (every weight is loaded afterwards)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """`torch.nn.init`'s in-place initialisers do nothing inside (as transformers' no_init_weights).

    Even on the meta device they are not free: `nn.Embedding`'s `normal_` there runs through
    torch's reference implementation, whose first call imports `torch._dynamo` and with it Triton,
    ~80 MB of resident memory that a CPU engine never uses."""
    names = [name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")]
    originals = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
