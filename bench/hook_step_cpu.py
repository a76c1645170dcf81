"""The hot path's host cost on CPU: `python -m bench.hook_step_cpu [--steps N]`.

One `RebalanceHook` of rank 0 (of G, a gloo world of one standing in: the commit
agreement runs, no plan comes) routes T tokens x top-K through L layers per step and
calls `step_end`; prints the median microseconds per step (route x L + step_end, windows
handed to an unstarted agent) as JSON, after a warm-up. It measures whichever
`worker_hooks` comes first on sys.path, so an old tree runs it with
`PYTHONPATH=<old tree>`; compare trees by alternating runs (BENCHMARKS.md, "Refactor
check: the hook split"). Trees from before HookConfig's sections are built with the flat
names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.shape import ClusterShape

L, E, P, G, T, K = 8, 64, 80, 4, 64, 8
WARMUP = 50


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            print(json.dumps(measure(args.steps)))
        finally:
            dist.destroy_process_group()
    return 0


def measure(steps: int) -> dict[str, object]:
    import worker_hooks.hook as h

    # A tree from before the link: the address and deployment as fields of their own.
    where: dict[str, Any] = (
        dict(link=h.Link("127.0.0.1:1", deployment="bench"))
        if hasattr(h, "Link")
        else dict(controller="127.0.0.1:1", deployment="bench")
    )
    # A tree from before the nested shape: the model's shape as fields of their own.
    flat_shape: dict[str, Any] = dict(num_layers=L, num_logical=E, num_slots=P, num_gpus=G)
    shaped = "shape" in {f.name for f in dataclasses.fields(h.HookConfig)}
    common: dict[str, Any] = dict(
        **where,
        rank=0,
        **(dict(shape=ClusterShape(**flat_shape, expert_bytes=0)) if shaped else flat_shape),
    )
    if hasattr(h, "WindowConfig"):
        config = h.HookConfig(
            **common,
            windows=h.WindowConfig(steps=16),  # type: ignore[arg-type]
            commit=h.CommitConfig(agree_every=4),
        )
    else:  # a tree from before the sections
        config = h.HookConfig(**common, window_steps=16, agree_every=4)  # type: ignore[arg-type, call-arg]
    hook = h.RebalanceHook(
        config,
        trivial_placement(L, E, P, G),
        {"w": torch.zeros(L, P // G, 1)},
        dist.group.WORLD,
        None,
    )
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, E, (T, K), generator=gen) for _ in range(L)]
    seconds = []
    for _ in range(steps + WARMUP):
        t0 = time.perf_counter()
        for layer in range(L):
            hook.route(layer, ids[layer])
        hook.step_end()
        seconds.append(time.perf_counter() - t0)
    hook.agreement.close()
    return {
        "tree": str(Path(h.__file__).resolve().parents[1]),
        "steps": steps,
        "median_us": round(1e6 * statistics.median(seconds[WARMUP:]), 1),
    }


if __name__ == "__main__":
    raise SystemExit(main())
