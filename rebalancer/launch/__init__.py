"""The launch toolkit: start the project's processes and reap them, for the demo, the
benches, the scripts and the tests alike (each imports it from here; it imports none of
them, nor the CLI).

- `processes`: free loopback ports, children bound to this process (a killed parent
  leaves none), reaping, how a process ended, `LaunchFailed`.
- `config`: `DemoConfig`, the shape, routing and policy of the demo's fleet, and the
  workers' time limit and pods derived from it.
- `routing`: the routing profile the workers replay (DeepSeek-V3's real loads).
- `workers`: the demo's CPU worker processes (worker_hooks.examples.cpu_worker), one gloo
  EP group.
- `sidecars`: one `rebalancer sidecar` per pod, ready before it returns.
- `fleet`: `Fleet`, a `rebalancer serve` controller with the demo's sidecars and workers
  as separate processes, each to be faulted alone.
- `instant`: the instant rank (a minimal in-process rank that registers, streams windows,
  prepares and commits at once) and `PoolMember`, a deployment of them in a replica pool.
- `prometheus`: a real Prometheus server scraping static targets, and its HTTP API.
- `dashboard`: the Grafana dashboard's queries asked of that Prometheus, and drawn.
"""
