"""`rebalancer demo`: the controller with an embedded demo on real routing data."""

from __future__ import annotations

import argparse
import json
import logging
import math


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a controller and CPU workers on real DeepSeek-V3 routing",
        description="Start a controller (gRPC + SQLite) and N CPU worker processes serving a small "
        "MoE model whose routing replays DeepSeek-V3's real expert loads drifting across workloads; "
        "print each window live and a summary.",
    )
    p.add_argument("--workers", type=int, default=4, help="EP ranks (worker processes), default 4")
    p.add_argument("--windows", type=int, default=30, help="windows of counts per rank, default 30")
    p.add_argument("--window-steps", type=int, default=16, help="forward steps per window, default 16")
    p.add_argument("--experts", type=int, default=32, help="logical experts per layer, default 32")
    p.add_argument("--slots", type=int, default=0, help="physical slots (default experts + workers*2)")
    p.add_argument("--layers", type=int, default=6, help="MoE layers, default 6")
    p.add_argument("--transport", choices=("p2p", "ipc"), default="p2p",
                   help="weight transfers between workers: gloo send/recv (default) or reads "
                        "from the peers' weights in shared memory")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where workers keep hooks and expert weights (cuda: one GPU per rank)")
    p.add_argument("--spare-rows", type=int, default=0,
                   help="spare weight rows per layer and worker: incoming experts land there "
                        "while serving and a commit only swaps maps (default 0: copy at commit)")
    p.add_argument("--db", default=None, help="SQLite file of the controller (default: temporary)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--verbose", action="store_true", help="controller and worker logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rebalancer.demo import DemoConfig, run_demo
    from rebalancer.errors import InputError

    if args.spare_rows < 0:
        raise InputError(f"--spare-rows must be >= 0, got {args.spare_rows}")
    if args.workers < 2 or args.windows < 4 or args.window_steps < 1:
        raise InputError("need --workers >= 2, --windows >= 4, --window-steps >= 1")
    if args.device == "cuda":
        import torch  # the workers' dependency; only asked here to fail early and clearly

        if torch.cuda.device_count() < args.workers:
            raise InputError(
                f"--device cuda needs one GPU per worker: {args.workers} workers, "
                f"{torch.cuda.device_count()} GPU(s) visible"
            )
    slots = args.slots or args.experts + 2 * args.workers
    if slots % args.workers or slots < args.experts:
        raise InputError(f"--slots {slots} must be a multiple of --workers and >= --experts")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = DemoConfig(
        workers=args.workers, layers=args.layers, experts=args.experts, slots=slots,
        steps=args.windows * args.window_steps, window_steps=args.window_steps, db_path=args.db,
        worker_log="INFO" if args.verbose else "WARNING", transport=args.transport,
        device=args.device, spare_rows=args.spare_rows,
    )
    summary = run_demo(config)
    print()
    print("summary")
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else value
        print(f"  {key:24s} {shown}")
    if args.json:
        print(json.dumps(summary))
    ok = summary["plans_committed"] >= 1 and summary["max_output_diff"] == 0.0
    return 0 if ok else 1
