"""Dispatch modes inside captured CUDA graphs (skipped without a GPU).

Each mode's `RebalanceHook.route` (record + dispatch, the water-fill for the load modes)
captured over every layer, replayed: equal to eager, deterministic across replays, and
equal to the same route on CPU (the ranks of a deployment must agree bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from bench.gpu_hooks import HookBenchConfig, capture, dispatch_hook

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", autouse=True)
def reap_compile_workers() -> Iterator[None]:
    """torch.compile (the compiled dispatch) starts inductor's pool of compile workers;
    they would outlive the tests until this process exits: reap them here."""
    yield
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


CFG = HookBenchConfig(
    tokens=256, num_layers=3, num_experts=64, top_k=4, dispatch_gpus=8, dispatch_slots=80
)


@pytest.mark.parametrize(
    ("mode", "compiled"),
    [
        ("split", False),
        ("load", False),
        ("load+shared", False),
        ("load", True),
        ("load+shared", True),
    ],
)
def test_capture_and_replay_equals_eager_and_cpu(mode: str, compiled: bool) -> None:
    """`compiled`: the water-fill fused by torch.compile (DispatchConfig.compile) gives
    the same slots as the eager water-fill on CPU, captured and replayed."""
    dev = torch.device("cuda")
    hook = dispatch_hook(replace(CFG, compile_dispatch=int(compiled)), mode, dev)
    gen = torch.Generator().manual_seed(1)
    ids_cpu = torch.randint(0, CFG.num_experts, (CFG.tokens, CFG.top_k), generator=gen)
    ids = ids_cpu.to(dev)
    out = [
        torch.empty(CFG.tokens, CFG.top_k + 1, dtype=ids.dtype, device=dev)
        for _ in range(CFG.num_layers)
    ]

    def route() -> None:
        for layer in range(CFG.num_layers):
            out[layer].copy_(hook.route(layer, ids))

    graph = capture(route)
    hook.recorder.take_window()  # warm-up and capture-time counts dropped
    graph.replay()
    torch.cuda.synchronize()
    first = [o.clone() for o in out]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, out, strict=True))  # deterministic
    route()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, out, strict=True))  # replay == eager
    cpu = dispatch_hook(CFG, mode, torch.device("cpu"))
    for layer in range(CFG.num_layers):
        assert torch.equal(cpu.route(layer, ids_cpu), first[layer].cpu())  # every rank agrees
    logical, _ = hook.recorder.take_window()
    assert (logical[:, CFG.num_experts] == 3 * CFG.tokens).all()  # 2 replays + eager, shared column
