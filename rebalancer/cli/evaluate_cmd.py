"""`rebalancer evaluate`: how well a saved placement balances a counts file."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="balancedness of a placement on a counts file",
        description="Report the balancedness (mean/max GPU load, averaged over layers "
        "with load) of PLACEMENT.json on the counts in PATH.",
    )
    parser.add_argument("--placement", required=True, metavar="PLACEMENT.json")
    parser.add_argument("--counts", required=True, metavar="PATH")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from rebalancer.errors import InputError
    from rebalancer.formats import load_counts, read_placement
    from rebalancer.placement import balancedness_per_layer, lower_bound_balancedness
    from rebalancer.placement.metrics import mean_balancedness

    saved = read_placement(args.placement)
    counts = load_counts(args.counts)
    if counts.shape != (saved.phy2log.shape[0], saved.num_logical):
        raise InputError(
            f"{args.counts}: counts shape {counts.shape} does not match the placement "
            f"({saved.phy2log.shape[0]} layers, {saved.num_logical} experts)"
        )
    per_layer = balancedness_per_layer(saved.phy2log, counts, saved.num_gpus)
    loaded = per_layer[~np.isnan(per_layer)]
    report = {
        "balancedness": mean_balancedness(per_layer),
        "min_layer_balancedness": float(loaded.min()) if loaded.size else 1.0,
        "bound_balancedness": lower_bound_balancedness(
            counts, saved.phy2log.shape[1], saved.num_gpus, saved.num_nodes
        ),
        "gpus": saved.num_gpus,
        "slots": int(saved.phy2log.shape[1]),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"balancedness {report['balancedness']:.4f} "
            f"(worst layer {report['min_layer_balancedness']:.4f}, "
            f"bound {report['bound_balancedness']:.4f})"
        )
    return 0
