"""ExpertRecorder on CPU: per-layer attribution, id formats, padding, window read-out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_hooks.record import ExpertRecorder
from worker_hooks.session.windows import WindowPipeline

# A DeepSeek-V4-like shape: 43 decoder layers, the first 3 routed by token-id hash,
# a few dense layers in between that never route, 256 routed experts + 1 fused shared.
NUM_LAYERS = 43
HASH_LAYERS = (0, 1, 2)
DENSE_LAYERS = (3, 20)
NUM_ROUTED = 256
SHARED_ID = NUM_ROUTED  # the shared expert fused as one more routed expert
TOP_K = 6


def _eager_reference(calls: list[tuple[int, torch.Tensor]], num_logical: int) -> np.ndarray:
    ref = np.zeros((NUM_LAYERS, num_logical), dtype=np.int64)
    for layer, ids in calls:
        flat = ids.reshape(-1).numpy().astype(np.int64)
        flat = flat[(flat >= 0) & (flat < num_logical)]
        np.add.at(ref[layer], flat, 1)
    return ref


def _model_forward(num_tokens: int, seed: int) -> list[tuple[int, torch.Tensor]]:
    """Routing decisions of one forward pass of the real-shaped model."""
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 129_280, (num_tokens,), generator=gen)
    calls = []
    for layer in range(NUM_LAYERS):
        if layer in DENSE_LAYERS:
            continue
        if layer in HASH_LAYERS:
            # Hash routing: experts are a fixed function of the token id, no gate.
            offsets = torch.arange(TOP_K) * 7919
            routed = ((token_ids[:, None] * 2654435761 + offsets) % NUM_ROUTED).to(torch.int32)
        else:
            scores = torch.rand(num_tokens, NUM_ROUTED, generator=gen) ** (1 + layer % 5)
            routed = torch.topk(scores, TOP_K, dim=-1).indices
        shared = torch.full((num_tokens, 1), SHARED_ID, dtype=routed.dtype)
        ids = torch.cat([routed, shared], dim=1)
        # Padding rows as a batch padded to a fixed size would carry.
        ids[-3:] = -1
        calls.append((layer, ids))
    return calls


def test_per_layer_attribution_on_real_shaped_model() -> None:
    rec = ExpertRecorder(NUM_LAYERS, NUM_ROUTED + 1)
    calls = _model_forward(64, seed=0) + _model_forward(32, seed=1)
    for layer, ids in calls:
        rec.record(layer, ids)
    logical, physical = rec.take_window()
    assert physical is None
    assert logical.dtype == np.int64 and logical.shape == (NUM_LAYERS, NUM_ROUTED + 1)
    np.testing.assert_array_equal(logical, _eager_reference(calls, NUM_ROUTED + 1))
    for layer in DENSE_LAYERS:
        assert logical[layer].sum() == 0
    for layer in HASH_LAYERS:
        # Hash-routed layers are recorded like any other: (64 + 32 - 2 * 3) tokens x top-k.
        assert logical[layer, :NUM_ROUTED].sum() == (96 - 6) * TOP_K
    # The fused shared expert gets every real token of every MoE layer.
    moe_layers = [lay for lay in range(NUM_LAYERS) if lay not in DENSE_LAYERS]
    assert (logical[moe_layers, SHARED_ID] == 96 - 6).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(12,), (4, 3), (2, 3, 2), (1, 1, 4, 3)])
def test_any_shape_and_integer_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    rec = ExpertRecorder(3, 5)
    ids = torch.tensor([0, 1, 1, -1, 4, 4, 4, 2, -1, 3, 0, 0], dtype=dtype).reshape(shape)
    rec.record(2, ids)
    logical, _ = rec.take_window()
    np.testing.assert_array_equal(logical[2], [3, 2, 1, 1, 3])
    assert logical[:2].sum() == 0


def test_padding_and_out_of_range_ids_are_ignored() -> None:
    rec = ExpertRecorder(2, 4)
    rec.record(1, torch.tensor([-1, -1, 4, 99, -7, 3]))
    logical, _ = rec.take_window()
    np.testing.assert_array_equal(logical, [[0, 0, 0, 0], [0, 0, 0, 1]])


@pytest.mark.parametrize("bad_layer", [None, -1, 3, 1.0, True])
def test_missing_or_bad_layer_is_an_error_and_records_nothing(bad_layer: object) -> None:
    rec = ExpertRecorder(3, 4)
    with pytest.raises(ValueError, match="explicit layer index"):
        rec.record(bad_layer, torch.tensor([0, 1]))  # type: ignore[arg-type]
    logical, _ = rec.take_window()
    assert logical.sum() == 0  # in particular nothing landed on layer 0


def test_layer_argument_is_required() -> None:
    rec = ExpertRecorder(3, 4)
    with pytest.raises(TypeError):
        rec.record(torch.tensor([0, 1]))  # type: ignore[call-arg]


def test_float_ids_rejected() -> None:
    rec = ExpertRecorder(1, 4)
    with pytest.raises(TypeError):
        rec.record(0, torch.tensor([0.0, 1.0]))


def test_physical_counts_and_window_zeroing() -> None:
    rec = ExpertRecorder(2, 4, num_physical=6)
    assert rec.physical_counts is not None
    storage = rec.logical_counts.data_ptr(), rec.physical_counts.data_ptr()
    rec.record(0, torch.tensor([[0, 1], [1, -1]]))
    rec.record_physical(0, torch.tensor([[5, 1], [2, -1]]))
    rec.record_physical(1, torch.tensor([0, 6, -1]))
    logical, physical = rec.take_window()
    np.testing.assert_array_equal(logical, [[1, 2, 0, 0], [0, 0, 0, 0]])
    assert physical is not None
    np.testing.assert_array_equal(physical, [[0, 1, 1, 0, 0, 1], [1, 0, 0, 0, 0, 0]])
    # Zeroed in place: the next window starts empty, same storage.
    assert rec.logical_counts.sum() == 0 and rec.physical_counts.sum() == 0
    assert (rec.logical_counts.data_ptr(), rec.physical_counts.data_ptr()) == storage
    rec.record(1, torch.tensor([3]))
    logical, physical = rec.take_window()
    assert logical[1, 3] == 1 and logical.sum() == 1
    assert physical is not None and physical.sum() == 0


def test_record_physical_needs_num_physical() -> None:
    with pytest.raises(ValueError, match="num_physical"):
        ExpertRecorder(2, 4).record_physical(0, torch.tensor([0]))


class _Agent:
    """What a window pipeline hands windows to (the agent's `submit_window`), kept."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, int, int, list[list[int]], list[list[int]] | None]] = []

    def submit_window(
        self, first: int, steps: int, version: int, logical: np.ndarray, physical: np.ndarray | None
    ) -> None:
        self.windows.append(
            (
                first,
                steps,
                version,
                logical.tolist(),
                None if physical is None else physical.tolist(),
            )
        )


def test_the_window_pipeline_reads_the_recorders_counters_in_place() -> None:
    """The hook's windows: the session's pipeline copies the recorder's counters out and
    zeroes them in place (the tensors a captured graph adds to stay the same), windows
    queued in close order, each read with what was told at its close."""
    rec = ExpertRecorder(1, 3, num_physical=2)
    buffer = rec.counts.data_ptr()
    agent = _Agent()
    pipeline = WindowPipeline(agent, rec.counts)  # type: ignore[arg-type]
    pipeline.close_as(4, 0, rec.split)  # nothing recorded since step 0: an empty window is sent
    rec.record(0, torch.tensor([0, 1]))
    rec.record_physical(0, torch.tensor([1, 1]))
    pipeline.close_as(6, 2, rec.split)
    rec.record(0, torch.tensor([2, -1]))
    pipeline.close_as(6, 3, rec.split)  # no step since: stays open
    pipeline.close_as(7, 3, rec.split)
    assert agent.windows == [
        (0, 4, 0, [[0, 0, 0]], [[0, 0]]),
        (4, 2, 2, [[1, 1, 0]], [[0, 2]]),
        (6, 1, 3, [[0, 0, 1]], [[0, 0]]),
    ]
    assert rec.counts.data_ptr() == buffer and int(rec.counts.sum()) == 0
    assert (pipeline.sent, pipeline.tokens_sent, pipeline.in_flight) == (3, 3, 0)


def test_take_window_reads_and_zeroes() -> None:
    rec = ExpertRecorder(1, 3)
    rec.record(0, torch.tensor([0, 0, 2]))
    logical, physical = rec.take_window()
    np.testing.assert_array_equal(logical, [[2, 0, 1]])
    assert physical is None and int(rec.counts.sum()) == 0


def test_dense_logical_counts_add_what_record_would_count() -> None:
    """The dispatch by load counts a step's picks per expert once and hands the vector to
    the recorder (`add_logical_counts`): the same counts as `record` on the ids."""
    ids = torch.tensor([[0, 3, 3], [-1, 2, 9], [3, 0, 1]])  # -1 padding, 9 out of range
    by_ids = ExpertRecorder(num_layers=2, num_logical=4)
    by_ids.record(1, ids)
    dense = ExpertRecorder(num_layers=2, num_logical=4)
    dense.add_logical_counts(1, torch.tensor([2, 1, 1, 3]))
    assert torch.equal(by_ids.logical_counts, dense.logical_counts)
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        dense.add_logical_counts(0, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="layer index"):
        dense.add_logical_counts(2, torch.tensor([1, 2, 3, 4]))
    assert torch.equal(by_ids.logical_counts, dense.logical_counts)  # refused: nothing added
