"""The pod sidecar: one agent per inference pod, between its ranks and the controller.

Why it exists: without it every rank of every pod holds its own channel, credentials and
stream to the controller, and the controller holds one stream per GPU. The sidecar
serves the same WorkerService to the pod's ranks on a Unix socket (a rank's hook points
at `unix:///run/rebalancer/agent.sock` unchanged), merges their windows per sequence
number into one upstream stream registered as a group of ranks, relays plan phases down
and reports for the whole pod up (PREPARED only when every rank prepared), holds the
credentials, and rides out controller outages with a bounded merged buffer. Expert
weights never pass through it: ranks move them among themselves.

Modules, one concern each: `config` (settings from flags and the pod's environment),
`relay` (the plan relay state machine), `resize` (a resize of the EP group gathered from
the survivors' registrations), `pod` (the pod's state both sides share: the windows of
its ranks merged per seq into a bounded buffer, rebalancer.wire.windows), `ranks` (the
WorkerService the ranks speak on the socket), `upstream` (the one link to the
controller), `listen` (the socket: modes, one sidecar per path, the readiness probe),
`metrics` (Prometheus names, defined once), `merge` (an EP group's pods merged at the
leader pod's sidecar: its followers' TLS and health, the design), `daemon` (wiring,
health, shutdown).

Imports only the bottom layers (rebalancer.errors, rebalancer.v1, rebalancer.wire): no
controller, no placement, no torch.
"""
