"""The SGLang adapter's copy path on one GPU (skipped without CUDA): per-layer expert
tensors (`LayerWeights`, as SGLang holds them) staged on the side stream, then written in
place at commit, bit for bit, storage unchanged; an aborted plan changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_hooks.config import MigrationConfig
from worker_hooks.migration import MigrationExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOTS, LAYERS = 9, (3, 4, 6)


def weights(dev: torch.device) -> dict[str, dict[int, torch.Tensor]]:
    gen = torch.Generator(device=dev).manual_seed(0)
    return {
        "w13": {
            layer: torch.randn((SLOTS, 64, 48), generator=gen, device=dev, dtype=torch.bfloat16)
            for layer in LAYERS
        },
        "w2": {
            layer: torch.randn((SLOTS, 48, 32), generator=gen, device=dev, dtype=torch.bfloat16)
            for layer in LAYERS
        },
    }


def test_staged_rows_land_in_place_and_an_abort_changes_nothing() -> None:
    dev = torch.device("cuda", 0)
    w = weights(dev)
    before = {name: {layer: t.clone() for layer, t in per.items()} for name, per in w.items()}
    ptrs = {name: {layer: t.data_ptr() for layer, t in per.items()} for name, per in w.items()}
    # Every slot of layers 3 and 6 takes the next slot's expert; layer 4 is untouched.
    moves = np.array([(layer, 0, s, 0, (s + 1) % SLOTS) for layer in (3, 6) for s in range(SLOTS)])
    executor = MigrationExecutor(0, 1, w, None, MigrationConfig(transport="p2p"))
    executor.prepare(1, moves)
    executor.abort(1)
    for name in w:
        for layer in LAYERS:
            assert torch.equal(w[name][layer], before[name][layer])
    executor.prepare(2, moves)
    assert executor.commit(2) == len(moves)
    torch.cuda.synchronize()
    order = torch.tensor([(s + 1) % SLOTS for s in range(SLOTS)], device=dev)
    for name in w:
        for layer in LAYERS:
            expect = before[name][layer][order] if layer in (3, 6) else before[name][layer]
            assert torch.equal(w[name][layer], expect)
            assert w[name][layer].data_ptr() == ptrs[name][layer]
