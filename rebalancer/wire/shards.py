"""Shards by pool: which controller shard owns a deployment, one rule for every caller.

When one controller is not enough, N controller shards split the fleet (a StatefulSet
of N pods, a store each: docs/shards.md). Every replica pool, and every deployment
outside a pool, is owned by exactly one shard, so a pool's members always meet in one
controller (one pool estimate, one rolling). Who owns what is not stored anywhere and
never asked for: every process computes it with the rule below, from names it already
has:

- the owning key is the replica pool's name for a member of a pool, else the
  deployment's name (`owner_key`);
- the shard is the key's SHA-256, read as a number, modulo N (`shard_of`): the same
  answer in every process, machine and Python version (Python's `hash` of a str is
  salted per process), and about N-th of the keys each;
- the shard's address is the link's address with `{shard}` replaced by its index
  (`shard_address`): `rebalancer-{shard}.rebalancer.NS.svc.cluster.local:50051` names
  the pods of a StatefulSet `rebalancer` behind a headless Service `rebalancer`.

Who calls it: a link's `routed` (rebalancer.wire.link.Link, used by every client
channel: the engines' and agents' direct links, the sidecar once its ranks named the
deployment and pool), the admin CLI's fan-out, and the controller, which refuses a
Register that another shard owns. One shard (the default) owns everything: the rule is
then never consulted and nothing changes.

Standard library only.
"""

from __future__ import annotations

import hashlib

from rebalancer.errors import InputError

SHARD_FIELD = "{shard}"
# More shards than this is a typo: a fleet of 65,536 GPUs needs a handful.
MAX_SHARDS = 1024


def owner_key(deployment: str, pool: str = "") -> str:
    """What decides the owning shard: the replica pool's name for a member of a pool,
    else the deployment's name."""
    return pool or deployment


def shard_of(key: str, shards: int) -> int:
    """The shard (0 .. shards - 1) that owns `key` (owner_key): SHA-256 of its UTF-8
    bytes, the first 8 bytes as a big-endian number, modulo `shards`."""
    if shards <= 1:
        return 0
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def owner_shard(deployment: str, pool: str, shards: int) -> int:
    """The shard that owns `deployment` in `pool` ("": none) among `shards`."""
    return shard_of(owner_key(deployment, pool), shards)


def shard_address(template: str, shard: int) -> str:
    """The address of shard `shard`: `template` with `{shard}` replaced by its index (a
    template without it is one controller's address, returned as is)."""
    return template.replace(SHARD_FIELD, str(shard))


def parse_shards(value: str | int, what: str = "shards") -> int:
    """A shard count from text (a flag, a variable) or a number; InputError, one line
    naming `what`, unless it is a whole number from 1 to MAX_SHARDS."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= MAX_SHARDS:
        raise InputError(
            f"{what} {value!r}: the number of controller shards, a whole number from 1 to "
            f"{MAX_SHARDS}"
        )
    return int(text)


def check_shards(address: str, shards: int, what: str = "address") -> None:
    """The shard count and the address fit together (InputError, one line): more than
    one shard needs `{shard}` in the address, where each shard's index goes, unless the
    address is a pod's sidecar (`unix:`), which picks the shard itself."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise InputError(
            f"shards {shards!r}: the number of controller shards, a whole number from 1 to "
            f"{MAX_SHARDS}"
        )
    if shards > 1 and SHARD_FIELD not in address and not address.startswith("unix:"):
        raise InputError(
            f"{shards} controller shards need {SHARD_FIELD} in the {what} ({address!r}), "
            f"where each shard's index goes (e.g. rebalancer-{SHARD_FIELD}.rebalancer.NS.svc:50051)"
        )
