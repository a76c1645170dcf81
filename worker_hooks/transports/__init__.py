"""How a rank's expert weights travel for a plan: one `WeightTransport` per rank, picked
by `MigrationConfig.transport` (worker_hooks/config.py) with `make_transport`; the
migration executor (worker_hooks/migration.py) sees only its `connect` / `receive` /
`close`, and an engine asks the class (`transport_class`) what it needs: `group_backend`,
`one_host`, `maps_live_weights`.
- `P2PTransport` ("p2p", p2p.py): torch.distributed send/recv on a group of its own, a
  few layers per round, one packed buffer per peer and weight. Any hosts.
- `IpcTransport` ("ipc", ipc.py): ranks of one host map each other's live weights once
  and each receiver reads the rows it gains with `copy_` (on GPU: the copy engines, no
  SMs taken from serving).
- `OutboxTransport` ("outbox", outbox.py): as "ipc" through two bounded shared outboxes
  per rank that senders pack and receivers drain, for weights that cannot be mapped whole.
`shared_memory.py` is the mapping of peers' memory both one-host transports use;
`base.py` the interface and the plan a transport moves. Any transport can be paced to a
GB/s budget (`MigrationConfig.max_gbps`).
"""

from __future__ import annotations

from worker_hooks.config import TRANSPORTS, MigrationConfig, Transport
from worker_hooks.transports.base import WeightTransport
from worker_hooks.transports.ipc import IpcTransport
from worker_hooks.transports.outbox import OutboxTransport
from worker_hooks.transports.p2p import P2PTransport
from worker_hooks.weights import RankWeights

_TRANSPORT_CLASSES: dict[Transport, type[WeightTransport]] = {
    cls.name: cls for cls in (P2PTransport, IpcTransport, OutboxTransport)
}


def transport_class(name: Transport) -> type[WeightTransport]:
    """The class of the transport `name` (what it needs: `one_host`, `maps_live_weights`,
    `group_backend`)."""
    if name not in _TRANSPORT_CLASSES:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return _TRANSPORT_CLASSES[name]


def make_transport(config: MigrationConfig, ctx: RankWeights) -> WeightTransport:
    """The transport `config.transport` names, over this rank's weights."""
    return transport_class(config.transport)(ctx, config)
