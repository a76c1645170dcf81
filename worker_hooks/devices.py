"""One spelling of "the device": `cuda` means the current CUDA device, with its index.

Tensors always carry an index (`cuda:0`), so hooks compare against a resolved device;
otherwise `torch.device("cuda") != torch.device("cuda:0")` rejects valid input.
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
