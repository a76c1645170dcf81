"""`rebalancer sidecar`: the pod's agent between its ranks and the controller."""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Mapping
from typing import Any

from rebalancer.wire.link import LINK_ENV, Link, link_from_settings, link_settings

# The flags that fill the sidecar's link, by Link field, with their help: each one unset
# takes its environment variable (LINK_ENV), the names the engines read too.
LINK_FLAGS: dict[str, tuple[str, str]] = {
    "address": ("--controller", "the controller's host:port"),
    "deployment": ("--deployment", "only accept ranks of this deployment"),
    "pool": ("--pool", "the deployment's replica pool (empty: none)"),
    "ca_file": ("--ca", "the controller's CA (PEM): TLS upstream"),
    "cert_file": ("--cert", "client certificate (PEM): mutual TLS upstream"),
    "key_file": ("--key", "client private key (PEM)"),
    "token_file": ("--token-file", "file holding the deployment's worker token"),
    "shards": (
        "--shards",
        "controller shards (a StatefulSet's replicas); more than 1: --controller holds "
        "{shard}, and the pod connects to the shard that owns its pool or deployment",
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sidecar",
        help="run the pod sidecar (ranks on a local socket, one group stream to the controller)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Run next to an inference pod. The pod's ranks point their hook at the socket
            (HookConfig(link=Link("unix:///run/rebalancer/agent.sock", ...))) instead of the
            controller; the sidecar merges their windows into one stream registered as a
            group of the pod's ranks, relays plans (PREPARED for the pod only when every
            rank prepared), holds the credentials and rides out controller outages with a
            bounded buffer. Weights never pass through it.

            The pod's ranks: --ranks, or in a LeaderWorkerSet LWS_GROUP_SIZE and
            LWS_WORKER_INDEX with --ranks-per-pod. The controller: --controller or
            REBALANCER_ADDRESS; each flag of the link (--controller, --deployment, --pool,
            --ca, --cert, --key, --token-file, --shards) unset takes its REBALANCER_*
            variable, the names the engines read (an empty value: unset). Pod identity:
            POD_NAMESPACE/POD_NAME (downward API).

            Controller shards (docs/shards.md): with --shards N (REBALANCER_SHARDS) the
            address names every shard with {shard} where the index goes, e.g.
            rebalancer-{shard}.rebalancer.rebalancer.svc.cluster.local:50051, and the pod
            connects to the one that owns its replica pool (or its deployment, outside a
            pool), by the rule of rebalancer.wire.shards, once its ranks named them.

              rebalancer sidecar --controller rebalancer:50051 --ranks 0-7 --metrics-port 9401 \\
                  --ca /etc/rebalancer/ca.pem --token-file /etc/rebalancer/token

            Credential files are read at every connection attempt: with one missing the
            sidecar still serves its ranks (a missing token file: it connects without a
            token; a missing certificate file: it does not connect until the file is
            there), and says so in its log, its metrics and --check.

            Merging an EP group's pods (a LeaderWorkerSet): the leader pod's sidecar sums
            the group's windows and holds its one session; it listens for the other pods'
            sidecars with --merge-listen (and the group's ranks: --group-ranks, or
            LWS_GROUP_SIZE x --ranks-per-pod); they name it with --merge-leader
            (e.g. "$(LWS_LEADER_ADDRESS):50070"), and stream straight to the controller
            while it is away (--merge-wait), going back once it serves again.

              rebalancer sidecar --ranks-per-pod 8 --merge-listen 0.0.0.0:50070     # leader
              rebalancer sidecar --ranks-per-pod 8 --merge-leader "$LEADER:50070"   # others

            Or one flag for every pod of the group, the role from LWS_WORKER_INDEX (the
            manifests' components/sidecar-merge sets it):

              rebalancer sidecar --ranks-per-pod 8 --merge-port 50070

            As a startup probe (exit 0 once the sidecar serves; it prints the state of the
            link to the controller, which does not change the exit code):

              rebalancer sidecar --check unix:///run/rebalancer/agent.sock
            """),
    )
    p.add_argument(
        "--check",
        metavar="TARGET",
        help="probe a running sidecar's health at TARGET (unix:///...) and exit 0 if it serves",
    )
    p.add_argument(
        "--listen",
        default="unix:///run/rebalancer/agent.sock",
        help="the ranks' socket (default %(default)s)",
    )
    p.add_argument(
        "--socket-access",
        choices=("owner", "group"),
        default="group",
        help="owner: directory 0700, socket 0600; group: 0750, 0660 (default)",
    )
    for field_name, (flag, text) in LINK_FLAGS.items():
        p.add_argument(
            flag,
            dest=field_name,
            metavar=flag.lstrip("-").upper().replace("-", "_"),  # as the flag reads
            help=f"{text} (default ${LINK_ENV[field_name]})",
        )
    p.add_argument("--ranks", help="this pod's EP ranks, e.g. 0-7 or 8,9,10,11")
    p.add_argument(
        "--ranks-per-pod",
        type=int,
        help="with LWS_GROUP_SIZE / LWS_WORKER_INDEX: pod i holds ranks i*n .. i*n+n-1",
    )
    p.add_argument(
        "--pod", help="pod identity (default $POD_NAMESPACE/$POD_NAME, else the host name)"
    )
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default: no metrics server)")
    p.add_argument(
        "--metrics-host", default="0.0.0.0", help="metrics listen address (default %(default)s)"
    )
    p.add_argument(
        "--max-buffered-windows",
        type=int,
        default=64,
        help="merged windows held while the controller is away (default %(default)s)",
    )
    p.add_argument(
        "--grace", type=float, default=2.0, help="drain seconds on shutdown (default %(default)s)"
    )
    p.add_argument(
        "--timeout", type=float, default=2.0, help="--check: seconds to wait (default %(default)s)"
    )
    merge = p.add_argument_group("merging the EP group's pods at its leader's sidecar")
    merge.add_argument(
        "--merge-listen",
        metavar="HOST:PORT",
        help="lead the merge: this sidecar also serves the group's other sidecars here (TCP)",
    )
    merge.add_argument(
        "--group-ranks",
        help="with --merge-listen: every rank of the EP group (default with --ranks-per-pod: "
        "0 .. LWS_GROUP_SIZE x n - 1)",
    )
    merge.add_argument(
        "--merge-leader",
        metavar="HOST:PORT",
        help="follow: stream to the group's leader sidecar here, e.g. $(LWS_LEADER_ADDRESS):50070",
    )
    merge.add_argument(
        "--merge-tls-cert", help="with --merge-listen: server certificate (PEM): TLS to followers"
    )
    merge.add_argument("--merge-tls-key", help="the private key of --merge-tls-cert (PEM)")
    merge.add_argument(
        "--merge-port",
        metavar="PORT",
        help="in a LeaderWorkerSet (with --ranks-per-pod), one flag for the whole group: pod "
        "LWS_WORKER_INDEX=0 leads on 0.0.0.0:PORT, every other pod follows it at "
        "LWS_LEADER_ADDRESS:PORT (empty: no merging; the manifests' default)",
    )
    merge.add_argument(
        "--merge-wait",
        type=float,
        default=10.0,
        help="leader: seconds it waits for every follower before registering the ranks it has; "
        "follower: seconds the leader may be away before it streams straight to the "
        "controller (default %(default)s)",
    )
    merge.add_argument(
        "--merge-retry",
        type=float,
        default=5.0,
        help="follower, streaming straight to the controller: seconds between asking whether "
        "the leader serves again (default %(default)s)",
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=run)


def link_of(args: argparse.Namespace, env: Mapping[str, str]) -> Link:
    """The sidecar's link: each LINK_FLAGS flag given (even empty: off) wins over its
    variable in `env` (LINK_ENV, old names with a warning); blank values are unset."""
    settings = link_settings(env)
    for field_name in LINK_FLAGS:
        flag = getattr(args, field_name)
        if flag is not None:
            settings[field_name] = flag
    settings = {name: value for name, value in settings.items() if value}
    return link_from_settings({"address": "", **settings})


def lws_merge_roles(args: argparse.Namespace, env: Mapping[str, str]) -> argparse.Namespace:
    """`--merge-port` as the flags of this pod's role in its LeaderWorkerSet group: the
    leader pod (worker index 0) `--merge-listen 0.0.0.0:PORT`, the others `--merge-leader
    LWS_LEADER_ADDRESS:PORT` (InputError, one line, outside a LeaderWorkerSet pod)."""
    from rebalancer.errors import InputError
    from rebalancer.sidecar.config import lws_ranks

    if args.merge_listen or args.merge_leader:
        raise InputError("give --merge-port or --merge-listen / --merge-leader, not both")
    if args.ranks_per_pod is None:
        raise InputError(
            "--merge-port is for a LeaderWorkerSet's pods (--ranks-per-pod); elsewhere give "
            "--merge-listen or --merge-leader"
        )
    port = args.merge_port
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InputError(f"--merge-port must be a port number (1-65535), got {port!r}")
    first, *_ = lws_ranks(env, args.ranks_per_pod)  # checks LWS_GROUP_SIZE, LWS_WORKER_INDEX
    if first == 0:
        return argparse.Namespace(**{**vars(args), "merge_listen": f"0.0.0.0:{int(port)}"})
    leader = env.get("LWS_LEADER_ADDRESS", "")
    if not leader:
        raise InputError("--merge-port: LWS_LEADER_ADDRESS is not set (the leader pod's name)")
    return argparse.Namespace(**{**vars(args), "merge_leader": f"{leader}:{int(port)}"})


def merge_of(args: argparse.Namespace, env: Mapping[str, str], ranks: tuple[int, ...]) -> Any:
    """The sidecar's MergeConfig from the --merge-* flags (InputError, one line, for a
    leader and a follower at once)."""
    from rebalancer.errors import InputError
    from rebalancer.sidecar.config import MergeConfig, lws_ranks, parse_ranks

    if args.merge_listen and args.merge_leader:
        raise InputError("give --merge-listen (the group's leader) or --merge-leader, not both")
    if args.merge_port:
        args = lws_merge_roles(args, env)
    common = {
        "wait_seconds": args.merge_wait,
        "retry_leader_seconds": args.merge_retry,
    }
    if args.merge_listen:
        if args.group_ranks:
            group = parse_ranks(args.group_ranks)
        elif args.ranks_per_pod is not None:
            # The LeaderWorkerSet's pods of n ranks each: pod i holds i*n .. i*n + n - 1.
            lws_ranks({**env, "LWS_WORKER_INDEX": "0"}, args.ranks_per_pod)  # checks the env
            size = int(env["LWS_GROUP_SIZE"])
            group = tuple(range(size * args.ranks_per_pod))
        else:
            raise InputError("--merge-listen needs the group's ranks: --group-ranks")
        return MergeConfig(
            role="leader",
            listen=args.merge_listen,
            group_ranks=group,
            tls_cert_file=args.merge_tls_cert or None,
            tls_key_file=args.merge_tls_key or None,
            **common,
        )
    if args.group_ranks or args.merge_tls_cert or args.merge_tls_key:
        raise InputError("--group-ranks and --merge-tls-* are the leader's: give --merge-listen")
    if args.merge_leader:
        return MergeConfig(role="follower", leader=args.merge_leader, **common)
    return MergeConfig(**common)


def run(args: argparse.Namespace) -> int:
    import sys

    if args.check:
        from rebalancer.sidecar.config import socket_path
        from rebalancer.sidecar.listen import probe

        socket_path(args.check)  # a malformed target is bad input (exit 2), not "not ready"
        ok, seen = probe(args.check, args.timeout)
        if not ok:
            print(f"rebalancer sidecar: {args.check} is not serving ({seen})", file=sys.stderr)
            return 1
        # Serving, whatever the controller link's state: the ranks are served either way
        # (a probe that failed for that would keep the engine from starting).
        print(f"rebalancer sidecar: {args.check}: {seen}")
        return 0

    import asyncio
    import logging

    from rebalancer.errors import InputError
    from rebalancer.sidecar.config import SidecarConfig, lws_ranks, parse_ranks, pod_identity
    from rebalancer.sidecar.daemon import Sidecar, serve

    if args.ranks and args.ranks_per_pod is not None:
        raise InputError("give --ranks or --ranks-per-pod, not both")
    if args.ranks:
        ranks = parse_ranks(args.ranks)
    elif args.ranks_per_pod is not None:
        ranks = lws_ranks(os.environ, args.ranks_per_pod)
    else:
        raise InputError(
            "give --ranks, or --ranks-per-pod with LWS_GROUP_SIZE and LWS_WORKER_INDEX set"
        )
    config = SidecarConfig(
        link=link_of(args, os.environ),
        ranks=ranks,
        listen=args.listen,
        socket_access=args.socket_access,
        pod=args.pod or pod_identity(os.environ),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_buffered_windows=args.max_buffered_windows,
        grace_seconds=args.grace,
        merge=merge_of(args, os.environ, ranks),
    )
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )

    def ready(sidecar: Sidecar) -> None:
        metrics = f", metrics on :{sidecar.metrics_port}" if sidecar.metrics_port else ""
        if sidecar.merge_port is not None:  # before the metrics port, which ends the line
            metrics = f", merging the group's ranks on port {sidecar.merge_port}{metrics}"
        # One line on stdout that scripts (and tests) can wait for.
        print(
            f"sidecar serving on {sidecar.target} for ranks {config.ranks_label}{metrics}",
            flush=True,
        )

    try:
        asyncio.run(serve(config, ready))
    except OSError as exc:
        raise InputError(f"cannot serve on {config.listen}: {exc}") from None
    return 0
