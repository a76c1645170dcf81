"""Merging an EP group's pods at one sidecar: the leader pod's (issue 32).

An EP group often spans several pods (a LeaderWorkerSet: a leader and workers). Without
merging, each pod's sidecar holds a group session of its own pod's ranks; with it, the
controller sees one session per EP group, so it reads a quarter of the messages for a
group of 4 pods. No election and no coordination service: the role is configuration
(`MergeConfig.role`), the LeaderWorkerSet saying which pod leads and where it is
(`LWS_LEADER_ADDRESS`).

- The leader's sidecar serves its own ranks on the socket as always, and the same
  WorkerService on TCP (`MergeConfig.listen`) to the group's other sidecars, with the
  controller's rules: TLS when a server certificate is given (`tls_cert_file`, checked by
  the followers with the link's CA), and the deployment's worker token when the leader
  has one (its link's token file, read at each call). A follower's Register names its
  pod's ranks (`RegisterRequest.ranks`), checked like a rank's (deployment, shape,
  dispatch, top_k, pool; ranks of the group and not the leader's own; refused with a
  precise status, nothing changed); its windows are summed with the leader's ranks' per
  seq (rebalancer.wire.windows, the same rule), its plan reports stand for each of its
  ranks (PREPARED upstream only when every rank of the group prepared), and plan phases
  go to it once, as to a rank (rebalancer/sidecar/pod.py).
- The leader registers upstream once with the group's ranks, when every follower has
  joined, or after `wait_seconds` with the ranks it has (its own always; pod.py's rule).
  A follower that joins later, or whose stream ends, changes the ranks the session names:
  the leader registers the group again (a plan in flight then aborts, as when a rank
  restarts: all ranks of a group take a plan or none, invariant 5).
- A follower's upstream is the leader (rebalancer/sidecar/upstream.py). When the leader
  is unreachable or refuses it for `wait_seconds`, the follower streams straight to the
  controller, as a session of its own pod's ranks (the controller takes a deployment's
  ranks split over several sessions); every `retry_leader_seconds` it asks the leader's
  gRPC health, and once the leader serves it ends its direct session and goes back to
  it. Ranks are served by their own sidecar throughout: losing the merging sidecar
  degrades rebalancing (the leader pod's own ranks lose their sidecar, as any pod whose
  sidecar dies), never serving. Windows sent to one upstream and not acknowledged are
  dropped at a switch (numbered for the other); a few windows of the group may be missed,
  none counted twice.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rebalancer.errors import InputError
from rebalancer.sidecar.config import MergeConfig
from rebalancer.wire.channel import aio_channel, check_key_pair, read_file
from rebalancer.wire.link import Link


def server_credentials(merge: MergeConfig) -> grpc.ServerCredentials | None:
    """The leader's TLS for its followers (None: plain TCP); InputError, one line, for a
    file that is missing or not a key pair."""
    if not merge.tls_cert_file or not merge.tls_key_file:
        return None
    cert, key = read_file(merge.tls_cert_file), read_file(merge.tls_key_file)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise InputError(f"merge TLS certificate {merge.tls_cert_file}: no PEM certificate in it")
    check_key_pair(
        merge.tls_cert_file, merge.tls_key_file, "merge TLS certificate", "merge TLS key"
    )
    return grpc.ssl_server_credentials([(key, cert)])


async def leader_serves(leader: Link, timeout: float) -> bool:
    """Whether the leader's sidecar answers its gRPC health with SERVING now."""
    try:
        async with aio_channel(leader) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=timeout,
                metadata=leader.metadata(),
            )
    except (TimeoutError, grpc.aio.AioRpcError, InputError, ConnectionError):
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
