"""One EP rank serving a tiny transformers MoE model through the adapter: the tests' worker.

Each process is one rank of a gloo group. It builds the same random-weight model as every
other rank (`families.build_tiny_model`, one seed), attaches the adapter (its experts now
this rank's slots, rebalanced by the controller), and every step runs the model on its
own token batch, then `step_end()`. Every `--check-every` steps it also runs an unwrapped
copy of the model (transformers' own `batched_mm` experts, all experts in this process)
on the same tokens and records the largest logit difference per placement version, so a
test can assert bit-identical logits before and after live rebalances. At the end it
checks every slot row it holds against the expert its map names, and writes one JSON.

    python -m worker_hooks.engines.transformers.worker --rank 0 --world 2 --port 29500 \
        --controller 127.0.0.1:50051 --family qwen3_moe --out rank0.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.wire.link import Link
from worker_hooks.config import WindowConfig
from worker_hooks.engines.transformers.adapter import AdapterConfig, ExpertParallelModel, attach
from worker_hooks.engines.transformers.families import FAMILIES, build_tiny_model


def token_batch(step: int, rank: int, tokens: int, vocab: int, seed: int) -> torch.Tensor:
    """`[1, tokens]` ids of this rank's step, skewed (few ids are frequent) so routing is
    uneven and a rebalance has something to gain."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.2
    return torch.multinomial(weights, tokens, replacement=True, generator=gen).view(1, tokens)


def weights_match_map(ep: ExpertParallelModel, reference: torch.nn.Module) -> bool:
    """Every slot this rank serves holds, in its row, the expert its map names."""
    from worker_hooks.engines.transformers.adapter import WEIGHT_NAMES, find_moe_blocks

    hook = ep.hook
    rank, per_rank = hook.config.rank, hook.config.slots_per_rank
    for ref_block in find_moe_blocks(reference):
        layer = ref_block.layer
        for s in range(per_rank):
            row = int(hook.rows.rows[rank, layer, s])
            expert = int(hook.phy2log[layer, rank * per_rank + s])
            for name in WEIGHT_NAMES:
                held = hook.weights[name][layer, row]
                if not torch.equal(held, getattr(ref_block.block.experts, name)[expert]):
                    return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rendezvous port of the gloo group")
    p.add_argument("--controller", required=True)
    p.add_argument("--deployment", default="transformers")
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--redundant", type=int, default=2, help="redundant slots (P = E + this)")
    p.add_argument("--spare-rows", type=int, default=0)
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--window-steps", type=int, default=4)
    p.add_argument("--agree-every", type=int, default=2)
    p.add_argument("--check-every", type=int, default=1)
    p.add_argument(
        "--wait-version",
        type=int,
        default=0,
        help="after --steps, keep stepping until this version is committed",
    )
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("REBALANCER_LOG", "WARNING"),
        format=f"%(asctime)s rank{args.rank} %(name)s %(levelname)s %(message)s",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=30),
    )
    reference = build_tiny_model(args.family, seed=args.seed, experts=args.experts)
    model = copy.deepcopy(reference)
    ep = attach(
        model,
        AdapterConfig(
            Link(
                args.controller,
                token=os.environ.get("REBALANCER_WORKER_TOKEN"),
                deployment=args.deployment,
            ),
            redundant_slots=args.redundant,
            spare_rows=args.spare_rows,
            windows=WindowConfig(steps=args.window_steps),
            agree_every=args.agree_every,
        ),
    )
    ep.start()
    ep.hook.agent.connected.wait(timeout=10)  # serve anyway if the controller is not there

    vocab = int(getattr(reference.config, "vocab_size"))  # noqa: B009 (the module's attribute is untyped)
    diff_by_version: dict[int, float] = {}
    checked_by_version: dict[int, int] = {}
    versions: list[list[int]] = []  # [first step, version] runs
    deadline = time.monotonic() + args.max_seconds
    step = 0
    with torch.no_grad():
        while step < args.steps or (ep.version < args.wait_version and time.monotonic() < deadline):
            if not versions or versions[-1][1] != ep.version:
                versions.append([step, ep.version])
            ids = token_batch(step, args.rank, args.tokens, vocab, args.seed)
            logits = model(ids).logits
            if step % args.check_every == 0:
                diff = float((logits - reference(ids).logits).abs().max())
                v = ep.version
                diff_by_version[v] = max(diff_by_version.get(v, 0.0), diff)
                checked_by_version[v] = checked_by_version.get(v, 0) + 1
            ep.step_end()
            step += 1

    settled = ep.finish(timeout=5.0, transfer_timeout=15.0)
    result = {
        "rank": args.rank,
        "steps": step,
        "version": ep.version,
        "versions": versions,
        "commits": ep.hook.stats.commits,
        "prepared": ep.hook.stats.prepared,
        "aborted": ep.hook.stats.aborted,
        "bytes_received": ep.hook.stats.bytes_received,
        "max_logit_diff_by_version": {str(k): v for k, v in diff_by_version.items()},
        "checked_steps_by_version": {str(k): v for k, v in checked_by_version.items()},
        "phy2log": np.asarray(ep.hook.phy2log).tolist(),
        "weights_match_map": weights_match_map(ep, reference),
        "logical_counts_layers": len(ep.blocks),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    if not settled:
        os._exit(0)  # a transfer is blocked on a peer that left: leave without teardown
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
