"""The fault harness: real processes, real faults at every plan phase, invariants checked
from the ranks' own step logs (RELIABILITY.md).

It runs a `rebalancer serve` process on an SQLite store, one `rebalancer sidecar` per pod
and the G ranks of one gloo group (reliability.chaos_worker = worker_hooks.examples.cpu_worker with
a step log) on DeepSeek-V3 routing drifting over six workloads. Every gRPC link goes through a
loopback fault proxy (reliability/faultproxy.py): each rank's Unix socket to its sidecar, and
the sidecars' TCP link to the controller. Plans come from the policy and from forced
rebalances; faults are injected at random moments and, in turn, at each plan phase
(proposed, preparing, prepared, commit sent, commit agreed, switched), one per episode:

- SIGKILL / SIGTERM of a worker, a sidecar or the controller, SIGSTOP + SIGCONT of any;
  a killed controller is restarted on the same store, a killed sidecar on the same
  socket; a killed worker takes its gloo group with it (a gloo group cannot lose a
  member), so the episode kills the other ranks and starts the deployment's G ranks
  again, on the same sidecars and controller, from the placement they start with;
- link faults on any link: latency, bandwidth limit, dropped connections, half-open
  connections (accepted, never answered), blackhole for a few seconds;
- store faults: read-only store (the controller is restarted on it: it must refuse with
  one line, then start once the store is writable again), disk full (the store's small
  tmpfs filled for a few seconds under a live controller), torn WAL (kill -9, then a
  partial frame appended to the write-ahead log, restart). Read-only and disk full use a
  tmpfs when run as root; otherwise a size limit on the controller's files
  (RLIMIT_FSIZE) and file modes;
- a starved node (cpu_starve): 4 busy processes per CPU beside every process of the run
  for 2-20 s. `--hog N` runs N busy processes beside the whole campaign (a node other work
  keeps busy).

After each episode the harness waits (up to `settle_seconds`) for the store, the
controller and every rank to agree on the placement version (invariant 7). Checked from
the step logs: every step ran one version on every rank, all switched at the same step
(2); every output equals the unbalanced reference, bit for bit (1); no rank ever ran a
version the store does not hold as committed, and every rank ran every committed version
its group lived through (5); no step spent more than `step_wait_bound_ms` in the
rebalancer's code, route + step_end, where it would wait on a sidecar or the controller,
besides the time it waited for a CPU (reliability/chaos_worker.py, `hook_runq_ms`) (3).
Controller recovery: from the kill to every rank resynced (Status: all ranks connected on
the restarted controller).

The package: processes.py starts and reaps every process of the run, faults.py holds
the fault kinds registered by name (`FAULTS`), schedule.py the campaign's timeline from
its seed, checks.py the invariants and recovery times, harness.py the episode loop and
the report, __main__.py the command line:

    python -m reliability.chaos --seconds 300 --seed 1 --hog 2 --json
"""

from __future__ import annotations

from reliability.chaos.config import ChaosConfig
from reliability.chaos.faults import (
    ALL_KINDS,
    FAULTS,
    LINK_FAULTS,
    NODE_FAULTS,
    PROCESS_FAULTS,
    STORE_FAULTS,
)
from reliability.chaos.harness import Harness, run_chaos

__all__ = [
    "ALL_KINDS",
    "FAULTS",
    "LINK_FAULTS",
    "NODE_FAULTS",
    "PROCESS_FAULTS",
    "STORE_FAULTS",
    "ChaosConfig",
    "Harness",
    "run_chaos",
]
