"""`rebalancer trace`: build and inspect the traces `rebalancer simulate` replays.

`make` builds drifting traces from the real summed DeepSeek-V3 routing files (phase
changes, smooth mixes, bursts) for tests and demos; `info` summarises any trace file;
`convert` turns any readable trace (SGLang .pt, per-token .jsonl) into .npz.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rebalancer.cli.plan_cmd import check_output_path
from rebalancer.errors import InputError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trace",
        help="build (make), inspect (info) or convert routing traces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    make = sub.add_parser("make", help="build a drifting trace from summed routing files")
    make.add_argument("--kind", choices=("phase", "mix", "burst"), default="phase")
    make.add_argument("--out", required=True, help="output .npz")
    make.add_argument("--windows", type=int, default=240)
    make.add_argument(
        "--tokens-per-window", type=int, default=65536, help="independent tokens per window"
    )
    make.add_argument("--top-k", type=int, default=8, help="experts per token")
    make.add_argument("--window-seconds", type=float, default=5.0)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument(
        "--source",
        action="append",
        default=[],
        help="summed counts JSON ({'logical_count': [L][E]}); default: the DeepSeek-V3 files",
    )
    make.add_argument("--json", action="store_true", help="print only the JSON line")
    make.set_defaults(func=run_make)

    info = sub.add_parser("info", help="summarise a trace file")
    info.add_argument("path")
    info.add_argument("--tokens-per-window", type=int, default=8, help=".jsonl: tokens per window")
    info.set_defaults(func=run_info)

    convert = sub.add_parser("convert", help="write any readable trace as .npz")
    convert.add_argument("path")
    convert.add_argument("--out", required=True)
    convert.add_argument(
        "--tokens-per-window", type=int, default=8, help=".jsonl: tokens per window"
    )
    convert.add_argument("--window-seconds", type=float, default=None)
    convert.set_defaults(func=run_convert)


def _describe(trace: Any) -> dict[str, Any]:
    totals = trace.counts.sum(axis=2)  # [T, L]
    return {
        "name": trace.name,
        "windows": trace.num_windows,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "window_seconds": trace.window_seconds,
        "routed_per_window_per_layer_mean": float(totals.mean()),
    }


def _sources(paths: list[str]) -> dict[str, Any]:
    """--source files, read and checked like any counts file (rebalancer.formats: summed
    [L, E], a [T, L, E] dump is summed over T), without the layers that carry no load."""
    from rebalancer.formats import load_counts

    sources = {}
    for raw in paths:
        counts = load_counts(raw)
        counts = counts[counts.sum(axis=1) > 0]
        if not counts.size:
            raise InputError(f"{raw}: no layer carries any count")
        sources[Path(raw).stem] = counts
    return sources


def run_make(args: argparse.Namespace) -> int:
    from rebalancer.sim.generate import TraceGenConfig, deepseek_v3_sources, make_trace

    if not args.out.endswith(".npz"):
        raise InputError(f"--out must end in .npz, got {args.out!r}")
    check_output_path(args.out, "--out")  # before the work: a typo must not cost the trace
    if args.seed < 0:
        raise InputError(f"--seed must be >= 0, got {args.seed}")  # numpy's seeds are unsigned
    sources = _sources(args.source) if args.source else deepseek_v3_sources()
    config = TraceGenConfig(
        kind=args.kind,
        windows=args.windows,
        tokens_per_window=args.tokens_per_window,
        top_k=args.top_k,
        window_seconds=args.window_seconds,
        seed=args.seed,
    )
    trace = make_trace(sources, config, name=Path(args.out).stem)
    trace.save(args.out)
    summary = _describe(trace) | {"kind": args.kind, "seed": args.seed, "out": args.out}
    if not args.json:
        print(f"wrote {args.out}: {trace.num_windows} windows of {args.kind} drift")
    print(json.dumps(summary))
    return 0


def run_info(args: argparse.Namespace) -> int:
    from rebalancer.sim.trace import load_trace

    trace = load_trace(args.path, tokens_per_window=args.tokens_per_window)
    print(json.dumps(_describe(trace)))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from rebalancer.sim.trace import load_trace

    if not args.out.endswith(".npz"):
        raise InputError(f"--out must end in .npz, got {args.out!r}")
    check_output_path(args.out, "--out")
    trace = load_trace(
        args.path, tokens_per_window=args.tokens_per_window, window_seconds=args.window_seconds
    )
    trace.save(args.out)
    print(json.dumps(_describe(trace) | {"out": args.out}))
    return 0
