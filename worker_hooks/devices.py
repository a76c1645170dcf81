"""One spelling of "the device": `cuda` means the current CUDA device, with its index.

Tensors always carry an index (`cuda:0`), so hooks compare against a resolved device;
otherwise `torch.device("cuda") != torch.device("cuda:0")` rejects valid input. The hooks
run on CPU or CUDA (`DeviceKind`); any other device type is refused here, by name,
instead of failing later inside a stream or a host copy.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

__all__ = ["DEVICE_KINDS", "DeviceKind", "resolve_device"]

DeviceKind = Literal["cpu", "cuda"]
DEVICE_KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)


def resolve_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type not in DEVICE_KINDS:
        raise ValueError(
            f"worker_hooks run on {' or '.join(DEVICE_KINDS)}, got device {str(dev)!r}"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
