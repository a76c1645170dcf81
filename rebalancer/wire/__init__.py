"""The wire layer: what the controller and the workers must agree on, and nothing else.

- `codec`: numpy arrays <-> `rebalancer.v1.Array` messages, validated.
- `channel`: gRPC channel and server options (message sizes, keepalive) and client
  channels with TLS, mutual TLS and bearer tokens.
- `link`: `Link`, how a process reaches the controller (address, token, TLS files,
  deployment, worker id, pool), the one TLS rule, and its environment names (`LINK_ENV`).
- `delivery`: the window and report bookkeeping agents and sidecars share on that link.
- `service`: service registration refusing requests that do not parse (INVALID_ARGUMENT),
  used by both servers (controller, sidecar).
- `layout`: placement layout rules, `phy2log` -> replica tables, transfer-list columns.
- `dispatch`: the dispatch modes and the water-fill's constants and tables.
- `countfile`: the count file's keys and plain writer (recorder side and CLI side).
- `status`: how a status field the AdminService sends reads (`admin status`, the demo).

It sits at the bottom with `rebalancer.errors` and the generated `rebalancer.v1`: numpy,
grpc and protobuf only, so an inference process that imports `worker_hooks` loads
neither the controller nor the placement engine (nor scipy).
"""
