"""`rebalancer serve`: run the controller service until SIGTERM."""

from __future__ import annotations

import argparse
import textwrap


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

              rebalancer serve --config deploy/controller.toml --port 50051 --metrics-port 9400
            """),
    )
    p.add_argument("--config", help="TOML file: [server], [tls], [worker_tokens], [policy]")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks one)")
    p.add_argument("--db", help="SQLite file (default rebalancer.sqlite)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default: no metrics server)")
    p.add_argument("--admin-token-file", help="file holding the admin bearer token")
    p.add_argument("--tls-cert", help="server certificate chain (PEM); enables TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA for client certificates; requires mutual TLS")
    p.add_argument("--grace", type=float, help="drain seconds on shutdown (default 5)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    from dataclasses import replace
    from pathlib import Path

    from rebalancer.controller.config import ControllerConfig, load_config, validate_config
    from rebalancer.controller.server import ControllerServer, serve
    from rebalancer.errors import InputError

    config = load_config(args.config) if args.config else ControllerConfig()
    overrides = {
        "host": args.host, "port": args.port, "db_path": args.db, "metrics_port": args.metrics_port,
        "tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_client_ca": args.tls_client_ca,
        "grace_seconds": args.grace,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if args.admin_token_file:
        try:
            config = replace(config, admin_token=Path(args.admin_token_file).read_text().strip())
        except OSError as exc:
            raise InputError(f"--admin-token-file {args.admin_token_file}: {exc.strerror}") from None
    validate_config(config)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def ready(server: ControllerServer) -> None:
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
        # One line on stdout that scripts (and tests) can wait for.
        print(f"serving on {server.address}{metrics}", flush=True)

    try:
        asyncio.run(serve(config, ready))
    except OSError as exc:
        raise InputError(f"cannot serve on {config.host}:{config.port}: {exc}") from None
    return 0
