"""The DeepEP adapter: lazy import and the slot-id mapping, on CPU.

The exchange itself needs deep_ep and two GPUs (bench/deepep_slots.py runs it); here
the parts that do not are checked, and constructing an exchange is skipped cleanly
when deep_ep is absent.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from worker_hooks import deepep
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.record import ExpertRecorder


def test_module_import_does_not_import_deep_ep() -> None:
    code = "import sys, worker_hooks.deepep; print('deep_ep' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_without_deep_ep_says_what_to_do() -> None:
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    with pytest.raises(ImportError, match="build DeepEP"):
        deepep.load_deep_ep()


def test_topk_conversion_keeps_padding_and_checks_range() -> None:
    ids = torch.tensor([[0, 5, -1], [7, -1, 3]], dtype=torch.int32)
    out = deepep.to_deepep_topk(ids, num_physical=8)
    assert out.dtype == torch.int64 and out.is_contiguous()
    assert out.tolist() == ids.tolist()
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        deepep.to_deepep_topk(torch.tensor([[8]]), num_physical=8)
    with pytest.raises(ValueError):
        deepep.to_deepep_topk(torch.tensor([[-2]]), num_physical=8)
    with pytest.raises(ValueError):
        deepep.to_deepep_topk(torch.tensor([1, 2]), num_physical=8)
    with pytest.raises(TypeError):
        deepep.to_deepep_topk(torch.tensor([[1.0]]), num_physical=8)


def test_local_indices_back_to_global_slots() -> None:
    recv = torch.tensor([[0, -1, 3], [-1, -1, 1]], dtype=torch.int64)
    assert deepep.global_slots(recv, rank=2, slots_per_gpu=4).tolist() == [[8, -1, 11], [-1, -1, 9]]


def test_expected_receive_counts_follow_the_map() -> None:
    # Two source ranks route through their own dispatch; rank 1's slots are 3..5.
    log2phy = np.array([[[0, 4], [1, -1], [5, 2], [3, -1]]])
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [3, 1]])
    per_rank = [ReplicaDispatch(log2phy, 2, r).dispatch(0, ids).numpy() for r in range(2)]
    counts = deepep.expected_receive_counts(per_rank, rank=1, slots_per_gpu=3)
    flat = np.concatenate([p.reshape(-1) for p in per_rank])
    assert counts.tolist() == [int((flat == s).sum()) for s in (3, 4, 5)]
    assert counts.sum() == int(((flat >= 3) & (flat < 6)).sum())


def test_config_checks_layout() -> None:
    assert deepep.DeepEPConfig(num_physical=288, num_gpus=2).slots_per_gpu == 144
    with pytest.raises(ValueError):
        _ = deepep.DeepEPConfig(num_physical=10, num_gpus=3).slots_per_gpu


def test_received_counts_land_in_the_recorder_slice() -> None:
    rec = ExpertRecorder(3, 4, num_physical=6)
    rec.add_physical_counts(2, 3, torch.tensor([1, 0, 5], dtype=torch.int32))
    _, phys = rec.take_window()
    assert phys is not None and phys[2].tolist() == [0, 0, 0, 1, 0, 5]
    with pytest.raises(ValueError):
        rec.add_physical_counts(2, 4, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError):
        rec.add_physical_counts(None, 0, torch.tensor([1]))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ExpertRecorder(1, 2).add_physical_counts(0, 0, torch.tensor([1]))
