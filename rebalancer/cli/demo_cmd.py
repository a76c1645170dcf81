"""`rebalancer demo`: the controller with an embedded demo on real routing data."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import textwrap

SUMMARY_HELP = textwrap.dedent("""\
    the summary (with --json also one JSON object on the last line):
      windows, steps, workers   windows folded, forward steps per rank, worker processes
      sidecars                  pod sidecars the workers went through (0: direct)
      plans_proposed/_committed/_aborted, placement_version
      balancedness_first        routed balancedness (mean/max GPU load measured on the
                                workers' dispatched tokens; 1.0 = every GPU equally
                                loaded) averaged over the first 3 windows, i.e. on the
                                initial placement, before any rebalancing
      balancedness_last/_mean   the same over the last 3 windows / over every window
      slots_moved, bytes_moved  slot changes over all plans, weight bytes the workers received
      max_output_diff           largest difference between the workers' MoE outputs and an
                                unbalanced reference model on the same inputs (0.0:
                                rebalancing never changes the math)
      weights_match_map         every slot holds the expert its map says
      ranks_agree_on_versions   every rank ran every step on the same placement
      max_swap_ms, experts_copied_at_commit, seconds
      stopped_early             why the workers ran fewer steps than --windows asks ("" if
                                they ran them all: only their time limit ends them early)
      store                     the controller's store, when it outlives the demo (--db,
                                --keep)
    exit code 1 unless a plan committed (not asked with --controller), max_output_diff is
    0.0, the ranks agree on versions and the workers ran every window (else the reason
    on one line).
    with --controller ADDR: no controller is started; the workers (and sidecars) attach to
    the one at ADDR (`rebalancer serve`), and the demo prints the deployment's status each
    second instead of its windows; try `rebalancer admin status|history|force` meanwhile
    (docs/operations.md, "An operator's first hour"). The summary's windows and
    balancedness_first/_last are then what that status showed (the newest window's
    routed balancedness at each poll that found a new one), ranks_seen the most ranks it
    counted connected; exit code 1 if no worker ever registered there (no rank seen, no
    window folded: a wrong address or port).
    """)

# Shown beside these keys in the printed summary.
SUMMARY_NOTES = {
    "balancedness_first": "routed, mean of the first 3 windows: the initial placement",
    "balancedness_last": "routed, mean of the last 3 windows",
    "balancedness_mean": "routed, mean of every window",
}


def check_demo_shape(layers: int, experts: int, slots: int, workers: int) -> None:
    """The model shape the controller takes (wire/layout.py's limits), checked before
    any work: a range error, not an out-of-memory after the workers started."""
    from rebalancer.errors import InputError
    from rebalancer.wire.layout import MAX_LAYER_SLOTS, MAX_LAYERS, check_layout

    if not 1 <= layers <= MAX_LAYERS:
        raise InputError(f"--layers must be in [1, {MAX_LAYERS}], got {layers}")
    try:
        check_layout(experts, slots, workers)
    except InputError as exc:
        raise InputError(
            f"--experts {experts}, --slots {slots}, --workers {workers}: {exc}"
        ) from None
    if layers * slots > MAX_LAYER_SLOTS:
        raise InputError(
            f"--layers x --slots must be at most {MAX_LAYER_SLOTS}, got {layers} x {slots}"
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a controller and CPU workers on real DeepSeek-V3 routing",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a controller (gRPC + SQLite) and N CPU worker processes serving a small "
        "MoE model whose routing replays DeepSeek-V3's real expert loads drifting across "
        "workloads, by default in pods whose sidecar (`rebalancer sidecar`, one per pod on a Unix "
        "socket) speaks to the controller for them; print each window live and a summary.",
        epilog=SUMMARY_HELP,
    )
    p.add_argument("--workers", type=int, default=4, help="EP ranks (worker processes), default 4")
    p.add_argument(
        "--sidecars",
        type=int,
        default=None,
        help="pods of workers/N ranks, each behind its own sidecar (default 2 when the "
        "workers split evenly, else 1); 0: workers talk to the controller directly",
    )
    p.add_argument("--windows", type=int, default=30, help="windows of counts per rank, default 30")
    p.add_argument(
        "--window-steps", type=int, default=16, help="forward steps per window, default 16"
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="the workers' time limit (default: ample for every window asked, "
        "rebalancer.launch.config.time_limit); a run it cuts short exits 1 saying so",
    )
    p.add_argument("--experts", type=int, default=32, help="logical experts per layer, default 32")
    p.add_argument(
        "--slots", type=int, default=0, help="physical slots (default experts + workers*2)"
    )
    p.add_argument("--layers", type=int, default=6, help="MoE layers, default 6")
    p.add_argument(
        "--transport",
        choices=("p2p", "ipc"),
        default="p2p",
        help="weight transfers between workers: gloo send/recv (default) or reads "
        "from the peers' weights in shared memory",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where workers keep hooks and expert weights (cuda: one GPU per rank)",
    )
    p.add_argument(
        "--spare-rows",
        type=int,
        default=0,
        help="spare weight rows per layer and worker: incoming experts land there "
        "while serving and a commit only swaps maps (default 0: copy at commit)",
    )
    p.add_argument("--db", default=None, help="SQLite file of the controller (default: temporary)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the controller's Prometheus metrics on this port (0: any free), "
        "per-layer series included (default: none)",
    )
    p.add_argument(
        "--controller",
        default="",
        metavar="ADDR",
        help="attach the workers (and sidecars) to this running controller "
        "(`rebalancer serve`, host:port, plain gRPC) instead of starting one; "
        "shows its status each second (admin token: REBALANCER_ADMIN_TOKEN, "
        "worker token: REBALANCER_WORKER_TOKEN)",
    )
    p.add_argument(
        "--deployment", default="demo", help="deployment name the workers register (default demo)"
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary folder (store, rank results, sockets); default: removed",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--verbose", action="store_true", help="controller, sidecar and worker logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from rebalancer.demo import run_demo
    from rebalancer.errors import InputError
    from rebalancer.launch.config import DemoConfig, default_sidecars
    from rebalancer.launch.processes import LaunchFailed
    from rebalancer.wire.link import Link
    from worker_hooks.config import WindowConfig

    if args.spare_rows < 0:
        raise InputError(f"--spare-rows must be >= 0, got {args.spare_rows}")
    if args.workers < 2 or args.windows < 4 or args.window_steps < 1:
        raise InputError("need --workers >= 2, --windows >= 4, --window-steps >= 1")
    if args.max_seconds is not None and not (
        math.isfinite(args.max_seconds) and args.max_seconds > 0
    ):
        raise InputError(
            f"--max-seconds must be a positive number of seconds, got {args.max_seconds}"
        )
    sidecars = default_sidecars(args.workers) if args.sidecars is None else args.sidecars
    if sidecars < 0 or (sidecars and args.workers % sidecars):
        raise InputError(
            f"--sidecars {sidecars} must be 0 (direct) or divide --workers {args.workers} "
            "into pods of equal size"
        )
    if args.device == "cuda":
        import torch  # the workers' dependency; only asked here to fail early and clearly

        if torch.cuda.device_count() < args.workers:
            raise InputError(
                f"--device cuda needs one GPU per worker: {args.workers} workers, "
                f"{torch.cuda.device_count()} GPU(s) visible"
            )
    if args.controller and (args.db or args.metrics_port is not None):
        raise InputError(
            "--db and --metrics-port belong to the demo's own controller: with "
            "--controller, give them to `rebalancer serve`"
        )
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise InputError(f"--metrics-port must be a port number (0-65535), got {args.metrics_port}")
    if args.controller:
        from rebalancer.wire.channel import check_address

        check_address(args.controller)  # the sidecars and workers would each refuse it later
    slots = args.slots or args.experts + 2 * args.workers
    if slots % args.workers or slots < args.experts:
        raise InputError(f"--slots {slots} must be a multiple of --workers and >= --experts")
    check_demo_shape(args.layers, args.experts, slots, args.workers)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = DemoConfig(
        workers=args.workers,
        layers=args.layers,
        experts=args.experts,
        slots=slots,
        steps=args.windows * args.window_steps,
        windows=WindowConfig(steps=args.window_steps),
        db_path=args.db,
        worker_log="INFO" if args.verbose else "WARNING",
        transport=args.transport,
        device=args.device,
        spare_rows=args.spare_rows,
        sidecars=sidecars,
        keep=args.keep,
        metrics_port=args.metrics_port,
        attach=Link(args.controller) if args.controller else None,
        deployment=args.deployment,
        timeout_seconds=args.max_seconds,
    )

    def terminated(signum: int, frame: object) -> None:
        # SIGTERM unwinds like Ctrl-C: every worker and sidecar reaped, the folder removed.
        raise SystemExit(128 + signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    try:
        summary = run_demo(config)
    except LaunchFailed as exc:
        # Every worker and sidecar is reaped by now; what failed is said once, not as a traceback.
        print(f"rebalancer demo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    print()
    print("summary")
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else value
        note = f"  ({SUMMARY_NOTES[key]})" if key in SUMMARY_NOTES else ""
        print(f"  {key:24s} {shown}{note}")
    if args.json:
        print(json.dumps(summary))
    # Attached, the running controller's policy (or its operator) decides whether a plan
    # commits; the demo checks the math and the ranks' agreement only.
    committed = bool(args.controller) or summary["plans_committed"] >= 1
    ok = committed and summary["max_output_diff"] == 0.0 and summary["ranks_agree_on_versions"]
    if summary["stopped_early"]:
        print(f"rebalancer demo: error: {summary['stopped_early']}", file=sys.stderr)
        return 1
    if args.controller and not (summary["ranks_seen"] or summary["windows"]):
        seen = f" (last status: {summary['status_error']})" if summary["status_error"] else ""
        print(
            "rebalancer demo: error: no worker registered with the controller at "
            f"{args.controller} as deployment {args.deployment!r}: no rank connected, no window "
            f"folded{seen}",
            file=sys.stderr,
        )
        return 1
    return 0 if ok else 1
