"""`rebalancer plan`: compute a placement for a counts file, optionally from a previous one.

Besides the balancedness the placement engine optimises (each replica carries its expert's
load / replicas), it reports the balancedness the placement is predicted to reach under a
dispatch mode (`--dispatch`), the same prediction the controller's decisions use, with the
shared expert's load the count file measured (`shared_count`) or routed picks / --top-k.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in run() only: `rebalancer --help` stays numpy-free
    import numpy as np

    from rebalancer.formats import CountFile
    from rebalancer.wire.dispatch import DispatchMode


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="compute an expert placement from a counts file",
        description="Compute an expert placement for the counts in PATH and report its "
        "balancedness, the best reachable balancedness and the share of slots moved.",
    )
    parser.add_argument(
        "--counts",
        required=True,
        metavar="PATH",
        help="counts file: SGLang JSON/.pt dump or .npz with logical_count "
        "(and optionally the recorder's shared_count)",
    )
    parser.add_argument("--gpus", required=True, type=int, metavar="G", help="EP ranks")
    parser.add_argument(
        "--slots",
        required=True,
        type=int,
        metavar="P",
        help="physical expert slots per layer (multiple of G)",
    )
    parser.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        metavar="K",
        help="expert groups; hierarchical placement when K %% N == 0",
    )
    parser.add_argument(
        "--previous",
        metavar="PLACEMENT.json",
        help="current placement: plan migration-aware from it",
    )
    parser.add_argument(
        "--max-moved-fraction",
        type=float,
        default=None,
        metavar="F",
        help="at most this share of slots may change (needs --previous)",
    )
    parser.add_argument(
        "--max-moved-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="at most this many bytes of expert weights may move "
        "(needs --previous and --expert-bytes)",
    )
    parser.add_argument(
        "--expert-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of one expert's weights, for --max-moved-bytes",
    )
    parser.add_argument(
        "--algorithm",
        default="auto",
        help="auto (default), greedy, balanced, migration or reference",
    )
    parser.add_argument(
        "--dispatch",
        default=None,
        metavar="MODE",
        help="also report the placement's predicted balancedness under this "
        "dispatch mode: split (default), load or load+shared "
        "(rebalancer.wire.dispatch)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="routed experts per token: the shared expert's load is routed "
        "picks / K when the counts file has no shared_count",
    )
    parser.add_argument("--out", metavar="PLACEMENT.json", help="write the placement here")
    parser.add_argument(
        "--sglang-out", metavar="PATH", help="also write it for SGLang's --init-expert-location"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rebalancer.controller.decide import balance_under_dispatch
    from rebalancer.errors import InputError
    from rebalancer.formats import (
        read_counts,
        read_placement,
        write_placement,
        write_sglang_expert_location,
    )
    from rebalancer.placement import (
        balancedness,
        compute_placement,
        lower_bound_balancedness,
        transfers,
    )
    from rebalancer.wire.dispatch import DEFAULT_DISPATCH_MODE, check_dispatch_mode
    from rebalancer.wire.layout import trivial_placement

    # Where the results go, checked before any work: a typo must not cost a placement.
    for flag, out in (("--out", args.out), ("--sglang-out", args.sglang_out)):
        if out:
            check_output_path(out, flag)
    mode = check_dispatch_mode(args.dispatch or DEFAULT_DISPATCH_MODE, "--dispatch mode")
    count_file = read_counts(args.counts)
    counts = count_file.logical
    shared, shared_from = _shared_load(count_file, args.top_k, mode, args.counts)
    previous = None
    if args.previous:
        saved = read_placement(args.previous)
        if saved.num_gpus != args.gpus or saved.num_nodes != args.nodes:
            raise InputError(
                f"{args.previous}: placement is for {saved.num_gpus} GPUs / {saved.num_nodes} "
                f"nodes, not {args.gpus} / {args.nodes}"
            )
        if saved.phy2log.shape != (counts.shape[0], args.slots):
            raise InputError(
                f"{args.previous}: placement shape {saved.phy2log.shape} does not match the "
                f"counts ({counts.shape[0]} layers) and --slots {args.slots}"
            )
        if saved.num_logical != counts.shape[1]:
            raise InputError(
                f"{args.previous}: placement has {saved.num_logical} experts, "
                f"counts have {counts.shape[1]}"
            )
        previous = saved.phy2log
    if args.max_moved_fraction is not None and previous is None:
        raise InputError("--max-moved-fraction needs --previous")
    if args.max_moved_bytes is not None and previous is None:
        raise InputError("--max-moved-bytes needs --previous")
    start = time.perf_counter()
    result = compute_placement(
        counts,
        args.slots,
        args.gpus,
        args.nodes,
        args.groups,
        previous=previous,
        max_moved_fraction=args.max_moved_fraction,
        algorithm=args.algorithm,
        max_moved_bytes=args.max_moved_bytes,
        expert_bytes=args.expert_bytes,
    )
    seconds = time.perf_counter() - start
    bound = lower_bound_balancedness(counts, args.slots, args.gpus, args.nodes, args.groups)
    # Before: what serves these counts now, the --previous placement, else the trivial one a
    # deployment starts on (slot p holds expert p % E).
    before_from = "previous" if previous is not None else "trivial"
    before = (
        previous
        if previous is not None
        else trivial_placement(counts.shape[0], counts.shape[1], args.slots, args.gpus)
    )
    balancedness_before = balancedness(before, counts, args.gpus)
    dispatch_balancedness, _ = balance_under_dispatch(
        result.phy2log, counts, args.gpus, mode, shared
    )
    report = {
        "balancedness": result.balancedness,
        "balancedness_before": balancedness_before,
        "before": before_from,
        "bound_balancedness": bound,
        "moved_fraction": result.moved_fraction,
        "seconds": seconds,
        "algorithm": result.algorithm,
        "layers": int(counts.shape[0]),
        "experts": int(counts.shape[1]),
        "gpus": args.gpus,
        "slots": args.slots,
        "nodes": args.nodes,
        "max_replicas": int(result.logcnt.max()),
        "dispatch": mode,
        "dispatch_balancedness": dispatch_balancedness,
        "shared_load_from": shared_from,
    }
    if previous is not None:
        report["transfers"] = int(len(transfers(previous, result.phy2log, args.gpus, args.nodes)))
    if args.out:
        write_placement(args.out, result.phy2log, args.gpus, args.nodes, counts.shape[1])
        report["out"] = args.out
    if args.sglang_out:
        write_sglang_expert_location(args.sglang_out, result.phy2log)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{result.algorithm}: balancedness {balancedness_before:.4f} on the {before_from} "
            f"placement -> {result.balancedness:.4f} (bound {bound:.4f}), {mode} dispatch "
            f"{dispatch_balancedness:.4f}, moved {result.moved_fraction:.1%}, "
            f"{seconds * 1e3:.1f} ms"
        )
    return 0


def _shared_load(
    count_file: CountFile, top_k: int | None, mode: DispatchMode, path: str
) -> tuple[np.ndarray | None, str | None]:
    """(shared expert's load per layer [L] or None, where it came from: "shared_count",
    "top_k" or None). The file's measured count wins over the estimate from --top-k."""
    from rebalancer.errors import InputError
    from rebalancer.wire.dispatch import has_shared_replicas

    num_experts = count_file.logical.shape[1]
    if top_k is not None and not 1 <= top_k <= num_experts:
        raise InputError(
            f"--top-k must be in [1, {num_experts}] (the counts' experts), got {top_k}"
        )
    if count_file.shared is not None:
        return count_file.shared, "shared_count"
    if top_k is not None:
        return count_file.logical.sum(axis=1) / top_k, "top_k"
    if has_shared_replicas(mode):
        raise InputError(
            f"--dispatch {mode} needs the shared expert's load: {path} has no shared_count, "
            "give --top-k"
        )
    return None, None


def check_output_path(path: str, flag: str) -> None:
    """InputError naming the reason unless a file can be written at `path`."""
    from pathlib import Path

    from rebalancer.errors import InputError

    target = Path(path)
    folder = target.parent
    if not folder.exists():
        raise InputError(f"{flag} {path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: {folder} is not a folder")
    if target.is_dir():
        raise InputError(f"{flag} {path}: is a folder, not a file")
