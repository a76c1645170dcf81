"""The water-fill as one Triton kernel (worker_hooks/waterfill_triton.py) gives the same
integers as the torch ops, bit for bit, eager, captured in a CUDA graph and under
torch.compile; the whole dispatch with it equals the dispatch on CPU (skipped without a
GPU or without triton)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from bench.gpu_hooks import HookBenchConfig, capture, dispatch_hook
from rebalancer.placement.metrics import gpu_replicas
from rebalancer.wire.dispatch import WATERFILL_UNITS, waterfill_tables
from rebalancer.wire.layout import trivial_placement
from worker_hooks import waterfill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", autouse=True)
def reap_compile_workers() -> Iterator[None]:
    yield
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


def layer_inputs(seed: int, experts: int, gpus: int, slots: int, shared: bool, dev: torch.device):
    rng = np.random.default_rng(seed)
    phy2log = np.asarray(trivial_placement(1, experts, slots, gpus))
    phy2log[0, experts:] = rng.integers(0, experts, slots - experts)
    replicas = gpu_replicas(phy2log, experts, gpus)[0]
    if shared:
        replicas = np.concatenate([replicas, np.ones((1, gpus), dtype=replicas.dtype)])
    tables = torch.from_numpy(waterfill_tables(replicas)).to(dev)
    rows = replicas.shape[0]
    counts = torch.from_numpy(rng.multinomial(512, rng.dirichlet(np.full(rows, 0.3)), size=gpus)).to(dev)
    base = None if seed % 2 else torch.from_numpy(rng.integers(0, 50_000, gpus)).to(dev)
    return counts.sum(0) * WATERFILL_UNITS, waterfill.split_units(counts, tables), tables[1], base


@pytest.mark.parametrize(("experts", "gpus", "slots", "shared"),
                         [(256, 32, 288, True), (256, 32, 288, False), (30, 6, 42, True), (64, 8, 80, False)])
@pytest.mark.parametrize("passes", [1, 4, 8])
def test_the_kernel_gives_the_torch_integers(experts: int, gpus: int, slots: int, shared: bool, passes: int) -> None:
    pytest.importorskip("triton")
    fused = waterfill.waterfill_function("triton")
    dev = torch.device("cuda")
    moved = False
    for seed in range(4):
        demand, start, far, base = layer_inputs(seed, experts, gpus, slots, shared, dev)
        want = waterfill.waterfill(demand, start, far, base, passes)
        got = fused(demand, start, far, base, passes)
        assert torch.equal(got, want), (seed, int((got != want).sum()))
        moved = moved or not torch.equal(want, start)
    assert moved  # the inputs exercise the fill, not only its fallback to the start


@pytest.mark.parametrize(("mode", "compiled"), [("load", False), ("load+shared", False), ("load+shared", True)])
def test_dispatch_with_the_kernel_captured_equals_cpu(mode: str, compiled: bool) -> None:
    pytest.importorskip("triton")
    cfg = HookBenchConfig(tokens=256, num_layers=3, num_experts=64, top_k=4, dispatch_gpus=8, dispatch_slots=80,
                          compile_dispatch=int(compiled), waterfill_kernel="triton")
    dev = torch.device("cuda")
    hook = dispatch_hook(cfg, mode, dev)
    ids_cpu = torch.randint(0, cfg.num_experts, (cfg.tokens, cfg.top_k), generator=torch.Generator().manual_seed(2))
    ids = ids_cpu.to(dev)
    out = [torch.empty(cfg.tokens, cfg.top_k + 1, dtype=ids.dtype, device=dev) for _ in range(cfg.num_layers)]

    def route() -> None:
        for layer in range(cfg.num_layers):
            out[layer].copy_(hook.route(layer, ids))

    graph = capture(route)
    graph.replay()
    torch.cuda.synchronize()
    cpu = dispatch_hook(replace(cfg, compile_dispatch=0), mode, torch.device("cpu"))
    for layer in range(cfg.num_layers):
        assert torch.equal(cpu.route(layer, ids_cpu), out[layer].cpu())
