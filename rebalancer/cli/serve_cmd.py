"""`rebalancer serve`: run the controller service until SIGTERM."""

from __future__ import annotations

import argparse
import textwrap

# The cyclic collector's thresholds in the serving process (see `ready` in run).
GC_THRESHOLDS = (20_000, 20, 100)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the controller (gRPC worker + admin services, metrics)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Run the controller: the WorkerService that inference ranks stream counts to, the
            AdminService behind `rebalancer admin`, gRPC health checking and reflection, and
            Prometheus metrics on a port of their own. State (deployments, committed placements,
            plan and decision history, the ingest cursor) lives in an SQLite file, so a
            restarted controller resumes where it stopped. SIGTERM drains: health turns
            NOT_SERVING, calls in flight get --grace seconds.

            Settings come from --config (TOML; see deploy/controller.toml) and are overridden by
            the flags given. Example:

              rebalancer serve --config deploy/controller.toml --host 127.0.0.1 --db /tmp/r.sqlite

            Safe by default: a service without credentials (the admin service without an
            admin token, the worker service without [worker_tokens]; mutual TLS counts for
            both) is served on loopback only. Another --host is refused unless --insecure (or
            server.insecure = true) says so; either way the log says, as a WARNING at start,
            which services are unauthenticated and whether TLS is off.

            One controller per store and port: a second controller on the same --db (an
            exclusive lock on DB.lock, dropped by the kernel when the holder dies, however it
            dies) or the same --port is refused with exit code 7.

            Controller shards (docs/shards.md): when one controller is not enough, N of them
            (a StatefulSet, a store each) split the fleet by replica pool. Each is told its
            place, --shard INDEX --shards N (or [shard] index, count); it takes the pools and
            deployments the rule of rebalancer.wire.shards gives it, the rule the sidecars
            and engines use to pick it, and refuses the others' Registers
            (FAILED_PRECONDITION, naming the owning shard). Default: one shard, everything.

            Exit codes: 0 stopped cleanly (SIGTERM/SIGINT, drained); 2 bad input (a flag, the
            config file, the store file, a TLS file, a host or port that cannot be used);
            7 in use (the store or a port belongs to another process); 1 anything else.
            """),
    )
    p.add_argument(
        "--config", help="TOML file: [server], [tls], [worker_tokens], [policy], [shard]"
    )
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks one)")
    p.add_argument("--db", help="SQLite file (default rebalancer.sqlite)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default: no metrics server)")
    p.add_argument("--admin-token-file", help="file holding the admin bearer token")
    p.add_argument("--tls-cert", help="server certificate chain (PEM); enables TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA for client certificates; requires mutual TLS")
    p.add_argument("--grace", type=float, help="drain seconds on shutdown (default 5)")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="listen on a non-loopback --host although a service is unauthenticated "
        "(no token, no mutual TLS); refused without it",
    )
    p.add_argument(
        "--shard",
        type=int,
        metavar="INDEX",
        help="this controller's shard, 0 .. --shards - 1 (a StatefulSet pod's ordinal; default 0)",
    )
    p.add_argument(
        "--shards",
        type=int,
        metavar="N",
        help="controller shards splitting the fleet by pool (default 1: this one owns all)",
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import gc
    import logging
    from dataclasses import replace
    from pathlib import Path

    from rebalancer.controller.config import (
        ControllerConfig,
        ShardConfig,
        load_config,
        read_admin_token,
    )
    from rebalancer.controller.loop_busy import timed_loop
    from rebalancer.controller.server import ControllerServer, serve
    from rebalancer.errors import InputError

    config = load_config(args.config) if args.config else ControllerConfig()
    overrides = {
        "host": args.host,
        "port": args.port,
        "db_path": args.db,
        "metrics_port": args.metrics_port,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "grace_seconds": args.grace,
        "insecure": args.insecure,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if args.shard is not None or args.shards is not None:
        config = replace(
            config,
            shard=ShardConfig(
                index=config.shard.index if args.shard is None else args.shard,
                count=config.shard.count if args.shards is None else args.shards,
            ),
        )
    if args.admin_token_file:
        config = replace(
            config, admin_token=read_admin_token(Path(args.admin_token_file), "--admin-token-file")
        )
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )

    def ready(server: ControllerServer) -> None:
        # What startup built (modules, the server, restored deployments) lives as long as
        # the process: freeze it out of the cyclic collector, whose full passes otherwise
        # walk it every time and stall ingest for tens of milliseconds (issue 12's p99).
        gc.collect()
        gc.freeze()
        # Every window allocates a few dozen short-lived objects (messages, arrays,
        # futures) and nearly none that live. At the default thresholds (700, 10, 10) a
        # controller of 16,384 ranks in pods of 8 (bench/ingest.py, one run of 20 s measured
        # and its start) ran 425, 38 and 3 collections of the three generations, 1.1 s in
        # all, the full ones about 110 ms each, stalling every stream; at these, 14 young
        # ones, 0.13 s. Cycles are rare here: collect them less often.
        gc.set_threshold(*GC_THRESHOLDS)
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
        shard = config.shard
        shards = f", shard {shard.index} of {shard.count}" if shard.count > 1 else ""
        # One line on stdout that scripts (and tests) can wait for.
        print(f"serving on {server.address}{metrics}{shards}", flush=True)

    try:
        # The loop's waits are timed: rebalancer_event_loop_busy_seconds_total (loop_busy.py).
        with asyncio.Runner(loop_factory=timed_loop) as runner:
            runner.run(serve(config, ready))
    except InputError:
        raise  # one line already, naming what and why (InUseError: exit code 7)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise InputError(
            f"cannot serve on {config.host}:{config.port}: {exc.strerror or exc}{where}"
        ) from None
    return 0
