"""`rebalancer admin`: operate a running controller over the AdminService.

Exit codes: EXIT_CODES maps the controller's gRPC status to one (the help lists them
from it); 2 for bad input found before any call, 1 for any other gRPC status.

Controller shards (`--shards N`, REBALANCER_SHARDS; docs/shards.md): `--address` names
every shard (`{shard}` where the index goes). `status` and `history` ask every shard at
once and print each one's answer under its name; `force --pool` goes to the shard the
rule of rebalancer.wire.shards gives the pool; a verb on one deployment goes to the shard
that holds it (asked with Status, the rule checked on the pool it reports). A shard that
does not answer: one line on stderr naming it and why, the others' answers printed, exit
EXIT_SHARD_DOWN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rebalancer.wire.link import LINK_ENV
from rebalancer.wire.shards import SHARD_FIELD, owner_shard, parse_shards, shard_of
from rebalancer.wire.status import balancedness_text

if TYPE_CHECKING:
    from rebalancer.wire.link import Link

EXIT_CODES = {
    "INVALID_ARGUMENT": 2,
    "NOT_FOUND": 3,
    "FAILED_PRECONDITION": 4,
    "ALREADY_EXISTS": 4,
    "UNAVAILABLE": 5,
    "DEADLINE_EXCEEDED": 5,
    "UNAUTHENTICATED": 6,
    "PERMISSION_DENIED": 6,
}
# Any other gRPC status the controller answers with.
EXIT_OTHER = 1
# A force that started no plan (its decision says why) exits as a refusal does.
EXIT_REFUSED = EXIT_CODES["FAILED_PRECONDITION"]
# With --shards: a shard did not answer while others did (or a deployment was on none of
# those that did); one line on stderr for each shard that did not.
EXIT_SHARD_DOWN = 8
EXIT_MEANINGS = {
    0: "done",
    EXIT_OTHER: "failed: any other gRPC error (INTERNAL, RESOURCE_EXHAUSTED, ...), or a file "
    "the system refused",
    2: "bad input: usage, a flag or setting, an unwritable --out/--sglang file (nothing "
    "sent), or input the controller refused",
    3: "not found: no such deployment, or nothing stored for it yet",
    4: "refused in this state: a plan in flight, no counts yet, or a force that started no "
    "plan (ranks not connected, nothing to move)",
    5: "controller unreachable or too slow (--timeout)",
    6: "not authenticated or not allowed: --token / REBALANCER_ADMIN_TOKEN, client certificate",
    EXIT_SHARD_DOWN: "--shards: a controller shard did not answer (one line on stderr for each, "
    "naming it and why); the other shards' answers are printed, or the deployment was on none "
    "of them. Every shard down: the code of its error",
    130: "interrupted (Ctrl-C)",
}


def exit_codes_help() -> str:
    """The exit-code list of `rebalancer admin --help`, from EXIT_CODES and EXIT_MEANINGS."""
    lines = ["exit codes:"]
    for code, meaning in sorted(EXIT_MEANINGS.items()):
        statuses = sorted(name for name, c in EXIT_CODES.items() if c == code)
        lines.append(f"  {code:<4d} {meaning}" + (f" ({', '.join(statuses)})" if statuses else ""))
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "admin",
        help="inspect and steer a running controller",
        description="Talk to a controller's AdminService. The token comes from --token or "
        "REBALANCER_ADMIN_TOKEN. --json goes before or after the action.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exit_codes_help(),
    )
    p.add_argument(
        "--address",
        default=os.environ.get(LINK_ENV["address"], "127.0.0.1:50051"),
        help=f"controller host:port (env {LINK_ENV['address']}); with --shards, every "
        f"shard's, {SHARD_FIELD} where its index goes",
    )
    p.add_argument(
        "--shards",
        default=os.environ.get(LINK_ENV["shards"], "").strip() or "1",
        metavar="N",
        help=f"controller shards (env {LINK_ENV['shards']}; default 1): status and history "
        "ask every shard, force --pool goes to the pool's, a deployment's verb to the shard "
        "holding it",
    )
    p.add_argument(
        "--token", default=os.environ.get("REBALANCER_ADMIN_TOKEN"), help="admin bearer token"
    )
    p.add_argument("--ca", help="CA certificate of the server (enables TLS)")
    p.add_argument("--cert", help="client certificate (mutual TLS)")
    p.add_argument("--key", help="client key (mutual TLS)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    cmds = p.add_subparsers(dest="admin_command", metavar="ACTION", required=True)

    s = cmds.add_parser(
        "status",
        help="per pool and deployment: version, balancedness, plan in flight, last decision",
    )
    s.add_argument("deployment", nargs="?", default="", help="one deployment (default: all)")
    s = cmds.add_parser("placement", help="print or export the committed placement")
    s.add_argument("deployment")
    s.add_argument("--out", help="write PLACEMENT.json here")
    s.add_argument("--sglang", help="write SGLang's --init-expert-location file here")
    s = cmds.add_parser("history", help="plans and decisions, newest first")
    s.add_argument("deployment")
    s.add_argument("--limit", type=int, default=20)
    s = cmds.add_parser(
        "contingency",
        help="survivor placements planned for every single rank and node loss "
        "and each declared scale-down",
    )
    s.add_argument("deployment")
    s = cmds.add_parser(
        "regimes",
        help="the regime library of the regimes policy: recurring loads, "
        "their stays, the predictors' errors, the last decision's load",
    )
    s.add_argument("deployment")
    s = cmds.add_parser(
        "force",
        help="rebalance now, skipping the gate (or --dry-run): force DEP, or force --pool POOL",
    )
    s.add_argument("deployment", nargs="?", default="")
    s.add_argument(
        "--pool",
        default="",
        help="rebalance this replica pool (its placement rolled out to its members)",
    )
    s.add_argument(
        "--dry-run", action="store_true", help="show the plan, its gain and cost; start nothing"
    )
    s.add_argument(
        "--max-moved-fraction", type=float, default=0.0, help="budget for this plan (0: policy's)"
    )
    s.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a plan in flight for the deployment: wait up to this long for it to end first "
        "(default 0: refused at once, exit 4)",
    )
    for name, text in (
        ("pause", "stop automatic rebalancing"),
        ("resume", "resume automatic rebalancing"),
    ):
        s = cmds.add_parser(name, help=text)
        s.add_argument("deployment")
    s = cmds.add_parser("policy", help="get or set the policy: policy DEP [key=value ...]")
    s.add_argument("deployment")
    s.add_argument("settings", nargs="*", metavar="key=value")
    # --json after the action as well: SUPPRESS keeps the value given before it.
    for action in cmds.choices.values():
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object"
        )
    p.set_defaults(func=run)


def plain(msg: Any) -> dict[str, Any]:
    """A protobuf message as JSON-able Python values (64-bit integers stay numbers)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.type == field.TYPE_MESSAGE:
            value = [plain(v) for v in value] if _repeated(field) else plain(value)
        elif field.type == field.TYPE_BYTES:
            continue
        elif field.type == field.TYPE_ENUM:
            value = field.enum_type.values_by_number[value].name
        elif _repeated(field):
            value = list(value)
        out[field.name] = value
    return out


def _repeated(field: Any) -> bool:
    return bool(field.is_repeated)


def _fail(code: int, message: str) -> int:
    print(f"rebalancer admin: error: {' '.join(message.split())}", file=sys.stderr)
    return code


UINT32_MAX = 2**32 - 1


def _check_args(args: argparse.Namespace, pb: Any) -> list[tuple[str, Any]]:
    """Refuse bad flags before any call (exit 2, nothing sent); the parsed policy settings."""
    import math

    from rebalancer.errors import InputError

    texts = [
        ("--address", args.address),
        ("--token", args.token),
        ("deployment", getattr(args, "deployment", None)),
        *(("setting", s) for s in getattr(args, "settings", None) or []),
    ]
    for what, value in texts:
        if value is None:
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"{what} {value!r} is not valid UTF-8 text") from None
    if not args.address.strip():
        raise InputError("--address is empty; expected host:port")
    from rebalancer.wire.shards import check_shards

    args.shard_count = parse_shards(args.shards, "--shards")
    check_shards(args.address, args.shard_count, "--address")
    if args.token is not None and not all(0x20 <= ord(c) < 0x7F for c in args.token):
        raise InputError("--token must be printable ASCII (it travels as a gRPC header)")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise InputError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.admin_command == "history" and not 0 <= args.limit <= UINT32_MAX:
        raise InputError(f"--limit must be in [0, {UINT32_MAX}], got {args.limit}")
    if args.admin_command == "force" and bool(args.deployment) == bool(args.pool):
        raise InputError("force needs a deployment or --pool POOL (one of them)")
    if args.admin_command == "force" and not math.isfinite(args.max_moved_fraction):
        raise InputError(f"--max-moved-fraction must be a number, got {args.max_moved_fraction}")
    if args.admin_command == "force" and not (math.isfinite(args.wait) and args.wait >= 0):
        raise InputError(f"--wait must be a number of seconds >= 0, got {args.wait}")
    if args.admin_command == "force" and args.wait and args.pool:
        raise InputError("--wait waits for a deployment's plan, not a pool's")
    if args.admin_command == "policy":
        return _parse_settings(args.settings, pb)
    return []


def _parse_settings(settings: list[str], pb: Any) -> list[tuple[str, Any]]:
    """`key=value` items as (field, value) of the v1 Policy message; InputError otherwise."""
    from rebalancer.errors import InputError

    fields = pb.Policy.DESCRIPTOR.fields_by_name
    parsed: list[tuple[str, Any]] = []
    for item in settings:
        key, sep, value = item.partition("=")
        field = fields.get(key)
        if not sep or field is None:
            raise InputError(
                f"setting {item!r}: expected key=value with key one of {', '.join(fields)}"
            )
        if field.type == field.TYPE_MESSAGE:  # a list of node counts: "7,6", or "" for none
            counts = []
            for part in filter(None, (p.strip() for p in value.split(","))):
                if not part.isdigit():
                    raise InputError(
                        f"setting {item!r}: {part!r} is not a whole number of nodes "
                        "(a comma-separated list, e.g. 7,6; empty for none)"
                    )
                counts.append(int(part))
            parsed.append((key, counts))
            continue
        if field.type == field.TYPE_BOOL:
            if value.lower() not in ("true", "false", "1", "0"):
                raise InputError(f"setting {item!r}: {value!r} is not true or false")
            parsed.append((key, value.lower() in ("true", "1")))
            continue
        try:
            number: Any = int(value) if field.type == field.TYPE_UINT32 else float(value)
        except ValueError:
            kind = "an integer" if field.type == field.TYPE_UINT32 else "a number"
            raise InputError(f"setting {item!r}: {value!r} is not {kind}") from None
        if field.type == field.TYPE_UINT32 and not 0 <= number <= UINT32_MAX:
            raise InputError(f"setting {item!r}: {number} is out of range [0, {UINT32_MAX}]")
        parsed.append((key, number))
    return parsed


def _wait_for_plan_in_flight(
    stub: Any, pb: Any, kw: dict[str, Any], deployment: str, seconds: float
) -> None:
    """Until `deployment` has no plan in flight, at most `seconds` (said once on stderr);
    the force that follows is refused as usual if one still is."""
    deadline = time.monotonic() + seconds
    told = False
    while True:
        found = stub.Status(pb.StatusRequest(deployment=deployment), **kw).deployments
        in_flight = found[0].plan_in_flight if found else 0
        if not in_flight or time.monotonic() >= deadline:
            return
        if not told:
            print(
                f"waiting up to {seconds:g} s for plan v{in_flight} in flight to end",
                file=sys.stderr,
            )
            told = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _write(what: str, path: str, write: Any) -> None:
    """Run `write()`; an unwritable path is bad input naming the flag."""
    from rebalancer.errors import InputError

    try:
        write()
    except OSError as exc:
        raise InputError(f"{what} {path}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    # gRPC's C core logs a failed TLS handshake in lines of its own (ssl_transport_security.cc)
    # before the call fails; the error line below names the cause. GRPC_VERBOSITY set by the
    # caller wins; it is read when grpc is first imported (in this process: not yet, unless
    # a caller in the same process imported it, whose settings then stand).
    if "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc

    from rebalancer.v1 import rebalancer_pb2 as pb
    from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
    from rebalancer.wire.channel import sync_channel
    from rebalancer.wire.link import Link

    args.parsed_settings = _check_args(args, pb)
    link = Link(args.address, args.ca, args.cert, args.key, args.token, shards=args.shard_count)
    if link.shards > 1:
        return _run_sharded(args, link, pb, pb_grpc)
    config = link.shard(0)  # one controller: `{shard}`, if written, is 0
    with sync_channel(config) as channel:
        stub = pb_grpc.AdminServiceStub(channel)
        kw: dict[str, Any] = {"timeout": args.timeout, "metadata": config.metadata()}
        try:
            return _dispatch(args, stub, pb, kw)
        except grpc.RpcError as exc:
            return _fail(*_rpc_error(config, exc))


def _rpc_error(link: Link, exc: Any) -> tuple[int, str]:
    """(exit code, "STATUS: why") of a failed call on `link`: an UNAVAILABLE one with its
    likely cause (rebalancer.wire.channel.unavailable_cause)."""
    import grpc

    from rebalancer.wire.channel import unavailable_cause

    code, details = exc.code(), exc.details() or ""
    cause = unavailable_cause(link, details) if code == grpc.StatusCode.UNAVAILABLE else ""
    return EXIT_CODES.get(code.name, EXIT_OTHER), f"{code.name}: {cause or details}"


# ------------------------------------------------------------------ controller shards


@dataclass(frozen=True)
class _Answer:
    """One shard's answer to a call asked of every shard: its reply, or the gRPC error."""

    shard: int
    link: Link
    reply: Any = None
    error: Any = None

    @property
    def name(self) -> str:
        return f"shard {self.shard} ({self.link.address})"

    def not_found(self) -> bool:
        return self.error is not None and self.error.code().name == "NOT_FOUND"


def _ask_every_shard(
    args: argparse.Namespace, shards: list[Link], ask: Callable[[Any, dict[str, Any]], Any]
) -> list[_Answer]:
    """`ask(stub, call keywords)` of every shard at once, each answer or error by shard."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
    from rebalancer.wire.channel import sync_channel

    def one(index: int) -> _Answer:
        link = shards[index]
        with sync_channel(link) as channel:
            stub = pb_grpc.AdminServiceStub(channel)
            try:
                reply = ask(stub, {"timeout": args.timeout, "metadata": link.metadata()})
            except grpc.RpcError as exc:
                return _Answer(index, link, error=exc)
        return _Answer(index, link, reply=reply)

    with ThreadPoolExecutor(max_workers=len(shards)) as threads:
        return list(threads.map(one, range(len(shards))))


def _fail_shard(answer: _Answer) -> int:
    """The one stderr line of a shard that did not answer: its name and why."""
    code, text = _rpc_error(answer.link, answer.error)
    return _fail(code, f"{answer.name}: {text}")


def _run_sharded(args: argparse.Namespace, link: Link, pb: Any, pb_grpc: Any) -> int:
    """`rebalancer admin` across `link.shards` controller shards (the module's docstring)."""
    import grpc

    from rebalancer.wire.channel import sync_channel

    shards = [link.shard(i) for i in range(link.shards)]
    cmd = args.admin_command
    if cmd == "status":
        answers = _ask_every_shard(
            args,
            shards,
            lambda stub, kw: stub.Status(pb.StatusRequest(deployment=args.deployment), **kw),
        )
        return _report_every_shard(
            args, answers, "status", lambda reply: _status_by_pool(reply) or "no deployments"
        )
    if cmd == "history":
        answers = _ask_every_shard(
            args,
            shards,
            lambda stub, kw: stub.History(
                pb.HistoryRequest(deployment=args.deployment, limit=args.limit), **kw
            ),
        )
        return _report_every_shard(args, answers, "history", _history_text)
    if cmd == "force" and args.pool:
        target = shard_of(args.pool, link.shards)  # the pool's owner, by the one rule
    else:
        found = _locate(args, shards, pb)
        if isinstance(found, tuple):
            return found[1]
        target = found
    config = shards[target]  # its answer printed as one controller's; an error names it
    with sync_channel(config) as channel:
        stub = pb_grpc.AdminServiceStub(channel)
        kw: dict[str, Any] = {"timeout": args.timeout, "metadata": config.metadata()}
        try:
            return _dispatch(args, stub, pb, kw)
        except grpc.RpcError as exc:
            return _fail_shard(_Answer(target, config, error=exc))


def _report_every_shard(
    args: argparse.Namespace, answers: list[_Answer], what: str, text: Callable[[Any], str]
) -> int:
    """Print every shard's answer under its name (--json: {"shards": [...]}) and one stderr
    line for each shard that did not answer. A deployment asked for: the shards that do
    not hold it (NOT_FOUND) are left out. Exit code: 0; EXIT_SHARD_DOWN when a shard did
    not answer but another did; the error's own code when none answered."""
    absent = [a for a in answers if args.deployment and a.not_found()]
    held = [a for a in answers if a.error is None]
    failed = [a for a in answers if a.error is not None and a not in absent]
    if args.json:
        entries = []
        for a in answers:
            if a in absent:
                continue
            entry: dict[str, Any] = {"shard": a.shard, "address": a.link.address}
            if a.error is None:
                entry[what] = plain(a.reply)
            else:
                entry["error"] = _rpc_error(a.link, a.error)[1]
            entries.append(entry)
        print(json.dumps({"shards": entries}))
    else:
        for a in held:
            print(f"{a.name}:\n" + "\n".join("  " + line for line in text(a.reply).splitlines()))
    codes = [_fail_shard(a) for a in failed]
    if not held and not failed:  # a deployment no shard holds
        return _fail(
            EXIT_CODES["NOT_FOUND"],
            f"NOT_FOUND: no shard holds deployment {args.deployment!r} "
            f"(all {len(answers)} answered)",
        )
    if not failed:
        return 0
    if not held and not absent:  # every shard failed: as one controller's error
        return codes[0]
    if not held:
        return _fail(
            EXIT_SHARD_DOWN,
            f"deployment {args.deployment!r} is on none of the shards that answered "
            f"({', '.join(str(a.shard) for a in absent)})",
        )
    return EXIT_SHARD_DOWN


def _locate(args: argparse.Namespace, shards: list[Link], pb: Any) -> int | tuple[None, int]:
    """The shard that holds `args.deployment`, asked of every shard with Status: the one
    the rule names for the pool it reports, else the first that holds it. Else (None,
    exit code), the reason said: NOT_FOUND (3) when every shard answered without it;
    EXIT_SHARD_DOWN with one line for each shard that did not answer."""
    dep = args.deployment
    answers = _ask_every_shard(
        args, shards, lambda stub, kw: stub.Status(pb.StatusRequest(deployment=dep), **kw)
    )
    holders = [a for a in answers if a.error is None and a.reply.deployments]
    for a in holders:
        if a.shard == owner_shard(dep, a.reply.deployments[0].pool, len(shards)):
            return a.shard
    if holders:
        return holders[0].shard
    failed = [a for a in answers if a.error is not None and not a.not_found()]
    codes = [_fail_shard(a) for a in failed]
    if not failed:
        code = _fail(
            EXIT_CODES["NOT_FOUND"],
            f"NOT_FOUND: no shard holds deployment {dep!r} (all {len(answers)} answered)",
        )
        return None, code
    if len(failed) == len(answers):
        return None, codes[0]
    answered = [str(a.shard) for a in answers if a not in failed]
    code = _fail(
        EXIT_SHARD_DOWN,
        f"deployment {dep!r} is on none of the shards that answered ({', '.join(answered)})",
    )
    return None, code


def _dispatch(args: argparse.Namespace, stub: Any, pb: Any, kw: dict[str, Any]) -> int:
    def show(msg: Any, text: str) -> None:
        if args.json:
            print(json.dumps(plain(msg)))
        else:
            print(text)

    cmd = args.admin_command
    ref = pb.DeploymentRef(deployment=getattr(args, "deployment", ""))
    if cmd == "status":
        reply = stub.Status(pb.StatusRequest(deployment=args.deployment), **kw)
        show(reply, _status_by_pool(reply) or "no deployments")
    elif cmd == "placement":
        from rebalancer.formats import write_placement, write_sglang_expert_location
        from rebalancer.wire import codec

        reply = stub.GetPlacement(ref, **kw)
        status = stub.Status(pb.StatusRequest(deployment=args.deployment), **kw).deployments[0]
        phy2log = codec.decode(reply.phy2log, "phy2log")
        if args.out:
            _write(
                "--out",
                args.out,
                lambda: write_placement(
                    args.out,
                    phy2log,
                    status.shape.num_gpus,
                    status.shape.num_nodes or 1,
                    status.shape.num_logical_experts,
                    reply.version,
                ),
            )
        if args.sglang:
            _write(
                "--sglang", args.sglang, lambda: write_sglang_expert_location(args.sglang, phy2log)
            )
        if args.json:
            print(json.dumps({"version": reply.version, "phy2log": phy2log.tolist()}))
        elif not (args.out or args.sglang):
            print(
                f"placement v{reply.version} of {args.deployment}: "
                f"{phy2log.shape[0]} layers x {phy2log.shape[1]} slots"
            )
            for layer, row in enumerate(phy2log):
                print(f"  layer {layer:3d}: {' '.join(map(str, row))}")
        else:
            print(
                f"wrote placement v{reply.version} to "
                f"{', '.join(p for p in (args.out, args.sglang) if p)}"
            )
    elif cmd == "history":
        reply = stub.History(pb.HistoryRequest(deployment=args.deployment, limit=args.limit), **kw)
        show(reply, _history_text(reply))
    elif cmd == "contingency":
        reply = stub.Contingency(ref, **kw)
        show(reply, _contingency_text(args.deployment, reply))
    elif cmd == "regimes":
        reply = stub.Regimes(ref, **kw)
        show(reply, _regimes_text(args.deployment, reply))
    elif cmd == "force":
        if args.wait and not args.dry_run:
            _wait_for_plan_in_flight(stub, pb, kw, args.deployment, args.wait)
        reply = stub.ForceRebalance(
            pb.ForceRebalanceRequest(
                deployment=args.deployment,
                pool=args.pool,
                dry_run=args.dry_run,
                max_moved_fraction=args.max_moved_fraction,
            ),
            **kw,
        )
        d = reply.decision
        text = (
            f"{d.outcome}: balancedness {d.balancedness_current:.3f} -> "
            f"{d.balancedness_candidate:.3f} "
            f"(bound {d.bound_balancedness:.3f}), moves {d.moved_fraction:.1%} of slots "
            f"({d.bytes_to_move / 1e6:.1f} MB), predicted gain {d.predicted_gain_seconds:.2f} s "
            f"vs cost "
            f"{d.migration_cost_seconds:.3f} s"
            + (f"; plan v{d.plan_version} started" if d.plan_version else "")
            + (
                f"; pool placement {reply.placement.version}, rolled out to its members"
                if args.pool and d.outcome == "forced" and not args.dry_run
                else ""
            )
        )
        if args.pool and reply.members:
            # The decision compares the pool placement with the pool's last one; what each
            # member's plan moves is from the placement it serves (one balanced alone while
            # diverged may move far more).
            text += "\neach member's own move, from the placement it serves:" + "".join(
                f"\n  {m.deployment} (v{m.placement_version}): "
                + (
                    "diverged (balanced alone): not rolled to, moves nothing"
                    if m.diverged
                    else (
                        f"{m.slots_moved} slots ({m.moved_fraction:.1%}), "
                        f"{m.bytes_to_move / 1e6:.1f} MB"
                    )
                )
                for m in reply.members
            )
        if args.json:
            out = plain(d)
            out["transfers"] = len(reply.transfers.data) // 20 if reply.transfers.data else 0
            if args.pool:
                out["members"] = [plain(m) for m in reply.members]
            print(json.dumps(out))
        elif args.dry_run or d.plan_version:
            print(text)
        if args.pool and not args.dry_run:
            if d.outcome != "forced":
                return _fail(
                    EXIT_REFUSED, f"pool {args.pool!r} placement unchanged: {d.outcome}: {d.reason}"
                )
            if not args.json:
                print(text)
        elif not args.dry_run and not d.plan_version:
            # Refused by the state it met (ranks missing, nothing to move, the store): the
            # decision is in the history, and the operator hears why, as for any refusal.
            return _fail(
                EXIT_REFUSED, f"no plan started for {args.deployment!r}: {d.outcome}: {d.reason}"
            )
    elif cmd in ("pause", "resume"):
        (stub.Pause if cmd == "pause" else stub.Resume)(ref, **kw)
        print(
            json.dumps({"deployment": args.deployment, "paused": cmd == "pause"})
            if args.json
            else f"{args.deployment}: {'paused' if cmd == 'pause' else 'resumed'}"
        )
    elif cmd == "policy":
        policy = stub.GetPolicy(ref, **kw)
        if args.settings:
            for key, value in args.parsed_settings:  # checked before any call (_check_args)
                if isinstance(value, list):
                    getattr(policy, key).CopyFrom(pb.NodeCounts(counts=value))
                else:
                    setattr(policy, key, value)
            policy = stub.SetPolicy(
                pb.SetPolicyRequest(deployment=args.deployment, policy=policy), **kw
            )
        show(
            policy,
            "\n".join(
                f"{f.name} = {_policy_value(getattr(policy, f.name))}"
                for f in policy.DESCRIPTOR.fields
            ),
        )
    return 0


def _history_text(reply: Any) -> str:
    """Plans, decisions and contingency sets, newest first."""
    lines = ["plans:"] + [
        f"  {_when(p.created)} v{p.version} from v{p.base_version} {p.state:10s} "
        f"{p.trigger:7s} {p.slots_moved} slots {p.bytes_moved / 1e6:.1f} MB {p.reason}"
        for p in reply.plans
    ]
    lines += ["decisions:"] + [
        f"  {_when(d.time)} {d.outcome:18s} {d.reason}" + (f" [load: {d.load}]" if d.load else "")
        for d in reply.decisions
    ]
    lines += ["contingency sets:"] + [
        f"  {_when(c.time)} on v{c.base_version}: rank loss worst {c.rank_loss_worst:.3f} mean "
        f"{c.rank_loss_mean:.3f}, node loss worst {c.node_loss_worst:.3f}"
        + (
            f" ({c.node_loss_unserved} experts a layer without a slot)"
            if c.node_loss_unserved
            else ""
        )
        for c in reply.contingency_sets
    ]
    return "\n".join(lines)


def _policy_value(value: Any) -> Any:
    """A Policy field as `admin policy` prints it: node counts as a list ("7, 6", "none")."""
    if hasattr(value, "counts"):
        return ", ".join(map(str, value.counts)) or "none"
    return value


def _regimes_text(name: str, reply: Any) -> str:
    """The library, one line per regime, last seen first."""
    policy = (
        "regimes policy"
        if reply.enabled
        else "adaptive policy (regimes off: admin policy DEP regimes=true)"
    )
    if not reply.regimes:
        return f"{name}: {policy}; no regime learned yet"
    errors = ", ".join(f"{k} {v:.4f}" for k, v in sorted(reply.predictor_errors.items()))
    lines = [
        f"{name}: {policy}; {len(reply.regimes)} regimes from {reply.windows} windows, current "
        f"{reply.current}; predictor errors: {errors or 'none yet'}",
        f"  {'regime':>6s} {'windows':>8s} {'stays':>6s} {'mean stay':>9s} "
        f"{'fit bal.':>8s} {'ready':>5s}  last seen",
    ]
    lines += [
        f"  {r.id:6d} {r.windows:8d} {r.visits:6d} {r.mean_stay_windows:9.1f} "
        f"{r.fit_balancedness:8.3f} "
        f"{'yes' if r.ready else 'no':>5s}  {_when(r.last_seen)}"
        for r in reply.regimes
    ]
    lines.append(f"  recent windows' regimes: {' '.join(map(str, reply.recent)) or '-'}")
    if reply.last_load:
        lines.append(f"  last decision's load: {reply.last_load}")
    return "\n".join(lines)


def _contingency_text(name: str, reply: Any) -> str:
    """One line per planned loss: balancedness after it, slots to refill, experts from storage."""
    if not reply.planned:
        return (
            f"{name}: no contingency set yet "
            f"(it is planned once counts arrive, for groups of 2+ ranks)"
        )
    lines = [
        f"{name}: survivor placements planned on v{reply.base_version} "
        f"at {_when(reply.computed_at)} "
        f"(balancedness now {reply.balancedness_now:.3f})",
        f"  {'loss':<18s} {'balancedness':>12s} {'slots moved':>12s} {'from storage':>13s}  note",
    ]
    nodes = [loss for loss in reply.losses if loss.kind == "node"]
    per_node = len(nodes[0].lost_ranks) if nodes else 0
    for loss in reply.losses:
        ranks = ",".join(map(str, loss.lost_ranks))
        what = f"{loss.kind} {ranks}" if loss.kind == "rank" else f"node (ranks {ranks})"
        note = (
            f"cannot serve: {loss.unserved} experts a layer without a slot" if loss.unserved else ""
        )
        if loss.kind == "scale_down" and per_node:  # a declared one: the tail nodes go
            first, last = loss.lost_ranks[0], loss.lost_ranks[-1]
            what = f"down to {first // per_node} nodes"
            note = f"ranks {first}-{last} go" + (f"; {note}" if note else "")
        bal = f"{loss.balancedness:.3f}" if not loss.unserved else "-"
        lines.append(
            (
                f"  {what:<18s} {bal:>12s} {loss.slots_moved:>12d} {loss.from_storage:>13d}  {note}"
            ).rstrip()
        )
    return "\n".join(lines)


def _status_by_pool(reply: Any) -> str:
    """Each pool's line, then its members; deployments without a pool last."""
    out = []
    for p in reply.pools:
        last = p.last_decision
        out.append(
            f"pool {p.pool}: placement {p.pool_version}, {len(p.members)} members "
            f"({len(p.diverged)} diverged"
            f"{': ' + ', '.join(p.diverged) if p.diverged else ''}), "
            f"balancedness on the pool estimate "
            f"{balancedness_text(p.balancedness_estimated, 'none yet')}; "
            f"rolling: {p.members_at_target}/{len(p.members) - len(p.diverged)} "
            f"on the pool placement, "
            f"{p.members_moving} moving (cap {p.max_moving})"
            + (f"\n  last pool decision: {last.outcome}: {last.reason}" if last.outcome else "")
        )
        for d in reply.deployments:
            if d.pool == p.pool:
                text = _status_text(d)
                out.append(
                    "  "
                    + text.replace("\n", "\n  ")
                    + ("\n    DIVERGED: balanced alone" if d.diverged else "")
                )
    out += [_status_text(d) for d in reply.deployments if not d.pool]
    return "\n".join(out)


def _status_text(d: Any) -> str:
    s = d.shape
    last = d.last_decision
    return (
        f"{d.deployment}: v{d.placement_version}, {d.connected_ranks}/{s.num_gpus} ranks, "
        f"L={s.num_layers} E={s.num_logical_experts} P={s.num_physical_slots} N={s.num_nodes}\n"
        f"  balancedness actual "
        f"{balancedness_text(d.balancedness_actual, 'no window measured yet')}, "
        f"on estimate {balancedness_text(d.balancedness_estimated, 'no counts folded yet')}; "
        f"{d.windows_folded} windows folded ({d.windows_ingested} received since start)"
        f"{', PAUSED' if d.paused else ''}\n"
        f"  plans committed {d.plans_committed}, aborted {d.plans_aborted}; "
        f"moved {d.slots_moved} slots, "
        f"{d.bytes_moved / 1e6:.1f} MB"
        + (f"\n  plan in flight: v{d.plan_in_flight} ({d.plan_phase})" if d.plan_in_flight else "")
        + (
            f"\n  MIXED PLACEMENT: {d.mixed}; no plan starts until its ranks restart"
            if d.mixed
            else ""
        )
        + (
            f"\n  last decision: {last.outcome}"
            + (f" (plan v{last.plan_version})" if last.plan_version else "")
            + f": {last.reason}"
            if last.outcome
            else ""
        )
    )


def _when(seconds: float) -> str:
    """A controller time (Unix seconds) as UTC, to the second; '-' when not set."""
    import time

    if not seconds > 0:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(seconds))
