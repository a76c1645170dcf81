"""Recorder and replica dispatch inside captured CUDA graphs (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.examples.moe_gpu import MoEBlockConfig, ReferenceMoEBlock
from worker_hooks.record import ExpertRecorder
from worker_hooks.session.windows import WindowPipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_LAYERS = 43
HASH_LAYERS = (0, 1, 2)
DENSE_LAYERS = (3, 20)
NUM_ROUTED = 256
SHARED_ID = NUM_ROUTED
TOP_K = 6
TOKENS = 512


def _capture(fn) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the graph, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _model_ids(step: int, dev: torch.device) -> list[torch.Tensor]:
    """One step's routing of every MoE layer of a 43-layer, 3-hash-layer model."""
    gen = torch.Generator(device=dev).manual_seed(step)
    tok = torch.randint(0, 129_280, (TOKENS,), generator=gen, device=dev)
    out = []
    for layer in range(NUM_LAYERS):
        if layer in HASH_LAYERS:
            off = torch.arange(TOP_K, device=dev) * 7919
            routed = ((tok[:, None] * 2654435761 + off) % NUM_ROUTED).to(torch.int32)
        else:
            scores = torch.rand(TOKENS, NUM_ROUTED, generator=gen, device=dev) ** (1 + layer % 5)
            routed = torch.topk(scores, TOP_K, dim=-1).indices.to(torch.int32)
        ids = torch.cat([routed, torch.full_like(routed[:, :1], SHARED_ID)], dim=1)
        ids[-(step % 7) - 1 :] = -1  # padding rows, a different amount every step
        out.append(ids)
    return out


def test_recorder_in_graph_equals_eager_after_replays() -> None:
    dev = torch.device("cuda")
    graph_rec = ExpertRecorder(NUM_LAYERS, NUM_ROUTED + 1, device=dev)
    eager_rec = ExpertRecorder(NUM_LAYERS, NUM_ROUTED + 1, device=dev)
    moe_layers = [lay for lay in range(NUM_LAYERS) if lay not in DENSE_LAYERS]
    static = {
        lay: torch.full((TOKENS, TOP_K + 1), -1, dtype=torch.int32, device=dev)
        for lay in moe_layers
    }

    def step() -> None:
        for lay in moe_layers:
            graph_rec.record(lay, static[lay])

    graph = _capture(step)
    graph_rec.take_window()  # drop the warm-up call's (all -1) counts: must be zero anyway
    ref = np.zeros((NUM_LAYERS, NUM_ROUTED + 1), dtype=np.int64)
    for n in range(12):
        ids = _model_ids(n, dev)
        for i, lay in enumerate(moe_layers):
            static[lay].copy_(ids[lay])
            eager_rec.record(lay, ids[lay])
            flat = ids[lay].reshape(-1).cpu().numpy()
            np.add.at(ref[lay], flat[flat >= 0], 1)
            assert i >= 0
        graph.replay()
    got, _ = graph_rec.take_window()
    eager, _ = eager_rec.take_window()
    np.testing.assert_array_equal(got, eager)
    np.testing.assert_array_equal(got, ref)
    for lay in DENSE_LAYERS:
        assert got[lay].sum() == 0
    assert got[list(HASH_LAYERS), :NUM_ROUTED].sum() > 0
    # Windows restart from zero in the same storage, and the graph keeps recording.
    graph.replay()
    again, _ = graph_rec.take_window()
    ids_last = static[moe_layers[0]].reshape(-1).cpu().numpy()
    assert again[moe_layers[0]].sum() == (ids_last >= 0).sum()


def test_missing_layer_in_capture_records_nothing() -> None:
    dev = torch.device("cuda")
    rec = ExpertRecorder(4, 8, device=dev)
    ids = torch.tensor([[0, 1], [2, 3]], device=dev)
    with pytest.raises(ValueError):
        rec.record(None, ids)  # type: ignore[arg-type]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        rec.record(None, ids)  # type: ignore[arg-type]
        rec.record(7, ids)
        rec.record(2, ids)
    assert rec.dropped_calls == 2
    for _ in range(5):
        graph.replay()
    logical, _ = rec.take_window()
    assert logical[0].sum() == 0  # nothing lands silently on layer 0
    assert logical[2].tolist() == [5] * 4 + [0] * 4
    assert logical.sum() == 20


class _Agent:
    def __init__(self) -> None:
        self.windows: list[tuple[np.ndarray, np.ndarray | None]] = []

    def submit_window(
        self, first: int, steps: int, version: int, logical: np.ndarray, physical: np.ndarray | None
    ) -> None:
        self.windows.append((logical, physical))


def test_window_pipeline_between_replays_without_host_sync() -> None:
    """The hook's windows on CUDA: the session's pipeline copies the recorder's counters
    (what the graph adds to) and zeroes them in place; a replay queued right behind the
    close belongs to the next window; a window is handed over only once its copy is done."""
    dev = torch.device("cuda")
    rec = ExpertRecorder(2, 16, num_physical=32, device=dev)
    ids = torch.randint(-1, 16, (1024, 8), device=dev)
    phys = torch.randint(-1, 32, (1024, 8), device=dev)
    graph = _capture(lambda: (rec.record(1, ids), rec.record_physical(0, phys)))
    rec.take_window()
    agent = _Agent()
    pipeline = WindowPipeline(agent, rec.counts)  # type: ignore[arg-type]
    step = 0
    for w in range(3):
        for _ in range(4 + w):
            graph.replay()
            step += 1
        pipeline.close_as(step, 0, rec.split)
        graph.replay()  # queued behind the copy and the zeroing: belongs to the next window
        step += 1
        while len(agent.windows) < w + 1:
            pipeline.poll()
    tail, _ = rec.take_window()
    exp_log = np.bincount(ids[ids >= 0].cpu().numpy(), minlength=16)
    exp_phy = np.bincount(phys[phys >= 0].cpu().numpy(), minlength=32)
    for w, (logical, physical) in enumerate(agent.windows):
        replays = 4 + w + (1 if w else 0)
        np.testing.assert_array_equal(logical[1], exp_log * replays)
        assert physical is not None
        np.testing.assert_array_equal(physical[0], exp_phy * replays)
    np.testing.assert_array_equal(tail[1], exp_log)


def test_dispatch_in_graph_follows_in_place_swap() -> None:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    num_layers, num_experts, num_gpus, per_gpu = 3, 64, 4, 20
    num_slots = num_gpus * per_gpu

    def random_map() -> np.ndarray:
        out = np.full((num_layers, num_experts, 4), -1, dtype=np.int64)
        for lay in range(num_layers):
            phy2log = rng.permutation(
                np.concatenate(
                    [np.arange(num_experts), rng.integers(0, num_experts, num_slots - num_experts)]
                )
            )
            fill = np.zeros(num_experts, dtype=np.int64)
            for slot, e in enumerate(phy2log):
                if fill[e] < 4:
                    out[lay, e, fill[e]] = slot
                    fill[e] += 1
        return out

    first, second = random_map(), random_map()
    disp = ReplicaDispatch(first, num_gpus=num_gpus, rank=1, device=dev, num_physical=num_slots)
    ids = torch.randint(-1, num_experts, (2048, 8), device=dev, dtype=torch.int32)
    out = torch.empty_like(ids)
    graph = _capture(lambda: out.copy_(disp.dispatch(2, ids)))
    graph.replay()
    cpu_first = ReplicaDispatch(first, num_gpus=num_gpus, rank=1, num_physical=num_slots)
    assert torch.equal(out.cpu(), cpu_first.dispatch(2, ids.cpu()))
    ptr = disp.table.data_ptr()
    disp.update_(second)
    graph.replay()  # no recapture
    cpu_second = ReplicaDispatch(second, num_gpus=num_gpus, rank=1, num_physical=num_slots)
    assert disp.table.data_ptr() == ptr
    assert torch.equal(out.cpu(), cpu_second.dispatch(2, ids.cpu()))
    assert not torch.equal(out.cpu(), cpu_first.dispatch(2, ids.cpu()))
    # Staged ahead, committed between replays.
    disp.stage(first)
    graph.replay()
    assert torch.equal(out.cpu(), cpu_second.dispatch(2, ids.cpu()))
    disp.commit()
    graph.replay()
    assert torch.equal(out.cpu(), cpu_first.dispatch(2, ids.cpu()))


def test_moe_block_graph_matches_eager_and_survives_swap() -> None:
    dev = torch.device("cuda")
    cfg = MoEBlockConfig(
        hidden=1024, intermediate=256, num_experts=32, top_k=4, num_layers=2, num_redundant=8
    )
    rng = np.random.default_rng(1)

    def placement() -> np.ndarray:
        return np.stack(
            [
                rng.permutation(np.concatenate([np.arange(32), rng.integers(0, 32, 8)]))
                for _ in range(2)
            ]
        )

    def log2phy(phy2log: np.ndarray) -> np.ndarray:
        out = np.full((2, 32, 9), -1, dtype=np.int64)
        for lay, row in enumerate(phy2log):
            fill = np.zeros(32, dtype=np.int64)
            for slot, e in enumerate(row):
                out[lay, e, fill[e]] = slot
                fill[e] += 1
        return out

    old, new = placement(), placement()
    disp = ReplicaDispatch(log2phy(old), num_gpus=1, rank=0, device=dev)
    rec = ExpertRecorder(2, 32, num_physical=40, device=dev)
    block = ReferenceMoEBlock(cfg, torch.from_numpy(old), dev, dispatch=disp, recorder=rec, seed=2)
    x = torch.randn(384, cfg.hidden, device=dev, dtype=cfg.dtype)
    out = torch.empty_like(x)
    eager = block.forward(x)
    graph = _capture(lambda: out.copy_(block.forward(x)))
    rec.take_window()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    logical, physical = rec.take_window()
    assert logical.sum() == physical.sum() == 2 * 384 * 4  # type: ignore[union-attr]
    block.fill_from(torch.from_numpy(new))
    disp.update_(log2phy(new))
    graph.replay()
    torch.cuda.synchronize()
    # Same picks computed from other slots: same bits (grouped GEMM rows are independent).
    assert torch.equal(out, eager)
