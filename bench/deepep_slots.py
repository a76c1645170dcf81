"""DeepEP intranode dispatch/combine with our physical slot ids: `python -m bench.deepep_slots`.

Needs deep_ep importable and 2 GPUs. Each rank routes its tokens with the recorder and
`ReplicaDispatch`, hands the slot ids to DeepEP with num_experts = P, and checks that
every received token carries exactly the picks the map sent to this rank's slots, that
DeepEP's per-slot receive counts equal the physical counts recorded on the senders,
and that combine returns each token's sum. Then the map is swapped in place and the
same checks run again. Prints figures and one JSON line last.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker_hooks.deepep import DeepEPConfig, SlotExchange, expected_receive_counts
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.record import ExpertRecorder

WORLD = 2
# DeepEP V1 intranode kernels take at most 128 experts (here: slots) per rank.
EXPERTS, SLOTS, TOP_K, TOKENS, HIDDEN = 240, 256, 8, 4096, 7168


def placement(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    phy2log = rng.permutation(
        np.concatenate([np.arange(EXPERTS), rng.choice(EXPERTS, SLOTS - EXPERTS)])
    )
    out = np.full((1, EXPERTS, 4), -1, dtype=np.int64)
    fill = np.zeros(EXPERTS, dtype=np.int64)
    for slot, e in enumerate(phy2log):
        out[0, e, fill[e]] = slot
        fill[e] += 1
    return out


def check_round(
    rank: int,
    exchange: SlotExchange,
    disp: ReplicaDispatch,
    rec: ExpertRecorder,
    dev: torch.device,
    seed: int,
) -> dict[str, float]:
    gen = torch.Generator(device=dev).manual_seed(seed * 10 + rank)
    ids = torch.topk(
        torch.rand(TOKENS, EXPERTS, device=dev, generator=gen) ** 3, TOP_K, dim=-1
    ).indices
    ids[-5:, -2:] = -1  # padding picks
    phys = disp.dispatch(0, ids)
    rec.record(0, ids)
    rec.record_physical(0, phys)
    weights = torch.rand(TOKENS, TOP_K, device=dev, generator=gen)
    # Token identity in exactly representable bf16 values: source rank, token // 256, token % 256.
    x = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16, device=dev)
    tok = torch.arange(TOKENS, device=dev)
    x[:, 0], x[:, 1], x[:, 2] = (
        rank,
        (tok // 256).to(torch.bfloat16),
        (tok % 256).to(torch.bfloat16),
    )
    x[:, 3:] = torch.randn(TOKENS, HIDDEN - 3, device=dev, generator=gen).to(torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = exchange.dispatch(x, phys, weights)
    torch.cuda.synchronize()
    t_dispatch = time.perf_counter() - t0
    all_phys = [torch.empty_like(phys) for _ in range(WORLD)]
    dist.all_gather(all_phys, phys)
    all_phys_np = [p.cpu().numpy() for p in all_phys]
    s = exchange.cfg.slots_per_gpu
    # 1. every received row carries the picks the source's map sent to this rank.
    src = got.x[:, 0].long().cpu().numpy()
    token = (got.x[:, 1].long() * 256 + got.x[:, 2].long()).cpu().numpy()
    slots = got.slots.cpu().numpy()
    wrong = 0
    for row in range(len(src)):
        sent = all_phys_np[src[row]][token[row]]
        mine = np.where((sent >= rank * s) & (sent < (rank + 1) * s), sent, -1)
        wrong += int(not np.array_equal(np.sort(mine), np.sort(slots[row])))
    expected_rows = sum(
        int(((p >= rank * s) & (p < (rank + 1) * s)).any(axis=1).sum()) for p in all_phys_np
    )
    # 2. DeepEP's receive counts equal what the senders' recorders counted.
    expected = expected_receive_counts(all_phys_np, rank, s)
    counts_ok = list(map(int, expected)) == got.per_slot
    rec.take_window()
    exchange.record_received(rec, 0, got)
    _, phys_counts = rec.take_window()
    assert phys_counts is not None
    recorder_ok = np.array_equal(phys_counts[0, rank * s : (rank + 1) * s], expected)
    # 3. combine: every rank returns its rows unchanged, the source sums them.
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    back = exchange.combine(got.x, got)
    torch.cuda.synchronize()
    t_combine = time.perf_counter() - t1
    n_ranks = torch.zeros(TOKENS, device=dev)
    for r in range(WORLD):
        n_ranks += ((phys >= r * s) & (phys < (r + 1) * s)).any(dim=1).float()
    combine_err = float(
        (back.float() - x.float() * n_ranks[:, None]).abs().max() / x.float().abs().max()
    )
    bytes_out = (
        float(sum(((phys >= r * s) & (phys < (r + 1) * s)).any(dim=1).sum() for r in range(WORLD)))
        * HIDDEN
        * 2
    )
    return {
        "received_rows": float(len(src)),
        "expected_rows": float(expected_rows),
        "rows_with_wrong_slots": float(wrong),
        "deepep_counts_match": float(counts_ok),
        "recorder_counts_match": float(recorder_ok),
        "combine_rel_err": combine_err,
        "dispatch_ms": 1e3 * t_dispatch,
        "combine_ms": 1e3 * t_combine,
        "dispatch_GBps": bytes_out / t_dispatch / 1e9,
    }


def worker(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=dev)
    group = dist.new_group(list(range(WORLD)))
    exchange = SlotExchange(group, DeepEPConfig(num_physical=SLOTS, num_gpus=WORLD))
    disp = ReplicaDispatch(placement(0), WORLD, rank, device=dev, num_physical=SLOTS)
    rec = ExpertRecorder(1, EXPERTS, num_physical=SLOTS, device=dev)
    results = {}
    for name, seed in (("before_swap_warm", 1), ("before_swap", 2)):
        results[name] = check_round(rank, exchange, disp, rec, dev, seed)
    disp.update_(placement(1))
    results["after_swap"] = check_round(rank, exchange, disp, rec, dev, 3)
    gathered: list[object] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        for r, res in enumerate(gathered):
            for phase, figures in res.items():  # type: ignore[union-attr,attr-defined]
                for k, v in figures.items():
                    print(f"rank{r} {phase:16s} {k:24s} {v:12.4f}", flush=True)
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"needs {WORLD} GPUs")
    mp.spawn(worker, args=(29533,), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
