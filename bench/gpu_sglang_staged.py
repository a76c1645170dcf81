"""One H200: the staged commit of a DeepSeek-V3-sized layer group with the SGLang adapter's
copy path, against the in-step work of SGLang's updater pattern on the same group.

The group: LAYERS MoE layers x 9 local slots (EP32: 288 slots / 32 GPUs), each expert
DeepSeek-V3's 3 x (7168 x 2048) bf16 (88 MB) in SGLang's fused layout: w13 [9, 4096, 7168]
and w2 [9, 7168, 2048] per layer, one tensor per layer as SGLang's
`routed_experts_weights_of_layer` holds them. The plan changes every slot of the group
(each layer's slots rotated by one): 45 experts, 3.96 GB, the default staging budget
(4 GiB) full.

* staged (worker_hooks.migration.MigrationExecutor on per-layer weights, what the adapter
  runs): `prepare` fills staging beside serving (side stream), then `commit` copies the
  staged rows into the live rows: the stall is that commit alone. Staging memory is the
  allocator's growth across prepare.
* SGLang's updater pattern (`update_expert_weights_single_layer`): per layer, inside the
  step, the layer's experts go into temporary buffers (local copies and p2p receives),
  then the buffers are copied into the live weights. One GPU cannot p2p with itself, so
  what is timed is the in-step copies alone: a LOWER BOUND of its stall; with peers the
  bytes that cross NVLink come on top.
* Serving beside staging: a bf16 8192^3 matmul loop on the default stream, its time per
  matmul with and without a prepare running on the side stream.

    python3 -m bench.gpu_sglang_staged [--layers 5] [--reps 5]   (prints one JSON line)
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

SLOTS = 9  # DeepSeek-V3 at EP32: 288 slots / 32 GPUs
HIDDEN, INTER = 7168, 2048  # DeepSeek-V3's hidden size and expert intermediate size


def live_weights(layers: int, dev: torch.device) -> dict[str, dict[int, torch.Tensor]]:
    w13 = {
        layer: torch.empty((SLOTS, 2 * INTER, HIDDEN), dtype=torch.bfloat16, device=dev)
        for layer in range(layers)
    }
    w2 = {
        layer: torch.empty((SLOTS, HIDDEN, INTER), dtype=torch.bfloat16, device=dev)
        for layer in range(layers)
    }
    for layer in range(layers):  # slot s holds "expert s" of its layer: a known value per row
        for s in range(SLOTS):
            w13[layer][s].fill_(float(layer * 16 + s))
            w2[layer][s].fill_(float(layer * 16 + s))
    return {"w13": w13, "w2": w2}


def rotation(layers: int) -> np.ndarray:
    """Transfers (layer, dst_rank, dst_slot, src_rank, src_slot): slot s gets slot s+1's expert."""
    rows = [(layer, 0, s, 0, (s + 1) % SLOTS) for layer in range(layers) for s in range(SLOTS)]
    return np.asarray(rows, dtype=np.int64)


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def updater_in_step(weights: dict[str, dict[int, torch.Tensor]], layers: int) -> None:
    """SGLang's per-layer pattern, the copies only: into temporary buffers of one layer,
    then back into the live weights (here the rotation, all moves local)."""
    order = torch.tensor([(s + 1) % SLOTS for s in range(SLOTS)], device=weights["w13"][0].device)
    temps = {name: torch.empty_like(per_layer[0]) for name, per_layer in weights.items()}
    for layer in range(layers):
        for name, per_layer in weights.items():
            torch.index_select(per_layer[layer], 0, order, out=temps[name])
            per_layer[layer].copy_(temps[name])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from worker_hooks.config import MigrationConfig
    from worker_hooks.migration import MigrationExecutor

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    weights = live_weights(args.layers, dev)
    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    executor = MigrationExecutor(0, 1, weights, None, MigrationConfig(transport="p2p"))
    moves = rotation(args.layers)
    group_bytes = len(moves) * expert_bytes

    commit_ms, prepare_s, staging_bytes = [], [], []
    for rep in range(args.reps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        stats = executor.prepare(rep + 1, moves)
        prepare_s.append(stats.seconds)
        staging_bytes.append(torch.cuda.max_memory_allocated(dev) - before)
        commit_ms += timed(lambda rep=rep: executor.commit(rep + 1), 1)
    # After the rotations every slot s of layer l holds expert (s + reps) % 9 of it.
    ok = all(
        bool((weights[name][layer][s] == float(layer * 16 + (s + args.reps) % SLOTS)).all())
        for name in weights
        for layer in range(args.layers)
        for s in range(SLOTS)
    )
    updater_ms = timed(lambda: updater_in_step(weights, args.layers), args.reps)

    # Serving beside staging: matmuls on the default stream, with and without a prepare.
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def matmuls(n: int = 40) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            a @ b
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / n

    alone = [matmuls() for _ in range(3)]
    beside = []
    for rep in range(3):
        version = 100 + rep
        thread = threading.Thread(target=executor.prepare, args=(version, moves))
        thread.start()
        beside.append(matmuls())
        thread.join()
        executor.abort(version)
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(dev),
                "torch": torch.__version__,
                "layers": args.layers,
                "slots_per_layer": SLOTS,
                "expert_mb": expert_bytes / 1e6,
                "group_gb": group_bytes / 1e9,
                "reps": args.reps,
                "staged_commit_ms": [round(x, 3) for x in commit_ms],
                "staged_commit_ms_median": round(float(np.median(commit_ms)), 3),
                "staging_gb": [round(x / 1e9, 3) for x in staging_bytes],
                "prepare_s": [round(x, 4) for x in prepare_s],
                "updater_in_step_copy_ms": [round(x, 3) for x in updater_ms],
                "updater_in_step_copy_ms_median": round(float(np.median(updater_ms)), 3),
                "matmul_ms_alone": [round(x, 3) for x in alone],
                "matmul_ms_beside_prepare": [round(x, 3) for x in beside],
                "weights_match": ok,
            }
        )
    )


if __name__ == "__main__":
    main()
