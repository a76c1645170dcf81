"""Prometheus metrics of one sidecar, on a port of its own; every name defined here once.

State (ranks connected, buffer depth, upstream state, the plan's phase) is read from the
Pod and the upstream link at scrape time by a custom collector, so nothing is copied on
the ranks' path; plan phase durations and outcomes are observed as the relay moves. Labels
are bounded: a fixed set of states and phases, never per rank or per expert (the pod
itself is the scrape target's label).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from rebalancer import __version__
from rebalancer.sidecar.pod import Pod
from rebalancer.sidecar.relay import Event, RelayPlan
from rebalancer.sidecar.upstream import UPSTREAM_STATES, VIAS, Upstream

# ---------------------------------------------------------------- names (the API)
INFO = "rebalancer_sidecar"  # _info{version, pod, ranks, controller}
RANKS = "rebalancer_sidecar_ranks"  # ranks this pod stands for
RANKS_CONNECTED = "rebalancer_sidecar_ranks_connected"  # ranks with a stream open
WINDOWS_IN = "rebalancer_sidecar_windows_in"  # counter: rank windows received
WINDOWS_OUT = "rebalancer_sidecar_windows_out"  # counter: merged windows sent upstream
WINDOWS_MERGED = "rebalancer_sidecar_windows_merged"  # counter: buffer full, two oldest merged
BUFFER_DEPTH = "rebalancer_sidecar_buffer_depth"  # merged windows waiting for upstream
UNACKED = "rebalancer_sidecar_unacked_windows"  # sent, not yet acknowledged
UPSTREAM_UP = "rebalancer_sidecar_upstream_up"  # 1 while the group stream is open
UPSTREAM_STATE = "rebalancer_sidecar_upstream_state"  # {state}: 1 for the current one
RECONNECTS = "rebalancer_sidecar_upstream_reconnects"  # counter
UPSTREAM_VIA = "rebalancer_sidecar_upstream_via"  # {via} controller | leader: 1 for the current
PLAN_VERSION = "rebalancer_sidecar_plan_version"  # newest plan relayed (0: none)
PLAN_PHASE = "rebalancer_sidecar_plan_phase"  # {phase}: 1 for the current one
PLAN_PHASE_SECONDS = "rebalancer_sidecar_plan_phase_seconds"  # {phase} prepare | commit
PLANS = "rebalancer_sidecar_plans"  # counter {outcome} committed | aborted

PLAN_PHASES = ("idle", "preparing", "prepared", "committing", "committed", "aborted")


class _StateCollector(Collector):
    def __init__(self, pod: Pod, upstream: Upstream) -> None:
        self.pod = pod
        self.upstream = upstream

    def collect(self) -> Iterator[Any]:
        pod, up, config = self.pod, self.upstream, self.pod.config
        info = InfoMetricFamily(INFO, "Build and identity of the sidecar.")
        info.add_metric(
            [],
            {
                "version": __version__,
                "pod": config.pod,
                "ranks": config.ranks_label,
                "controller": config.link.address,
                "deployment": pod.deployment,
            },
        )
        yield info
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield g(RANKS, "Ranks this pod's sidecar stands for.", value=len(pod.ranks))
        yield g(
            RANKS_CONNECTED, "Ranks with a stream open to the sidecar.", value=pod.connected_ranks
        )
        yield c(
            WINDOWS_IN, "Windows of counts received from the ranks.", value=pod.stats.windows_in
        )
        yield c(WINDOWS_OUT, "Merged windows sent to the controller.", value=pod.stats.windows_out)
        yield c(
            WINDOWS_MERGED,
            "Times the buffer was full and its two oldest windows were merged.",
            value=pod.buffer.merged,
        )
        yield g(BUFFER_DEPTH, "Merged windows waiting for the controller.", value=len(pod.buffer))
        yield g(
            UNACKED, "Windows sent to the controller and not acknowledged yet.", value=up.unacked
        )
        yield g(
            UPSTREAM_UP,
            "1 while the pod's stream to the controller is open.",
            value=1.0 if up.state == "connected" else 0.0,
        )
        state = g(
            UPSTREAM_STATE,
            "State of the link to the controller (1 for the current one).",
            labels=["state"],
        )
        for name in UPSTREAM_STATES:
            state.add_metric([name], 1.0 if up.state == name else 0.0)
        yield state
        yield c(RECONNECTS, "Reconnections to the controller.", value=up.reconnects)
        via = g(
            UPSTREAM_VIA,
            "Whom the link reaches (1 for the current one): the controller, or the EP "
            "group's leader sidecar (a follower of a merged group).",
            labels=["via"],
        )
        for whom in VIAS:
            via.add_metric([whom], 1.0 if up.via == whom else 0.0)
        yield via
        plan = pod.relay.plan
        yield g(
            PLAN_VERSION,
            "Newest plan relayed to the ranks (0: none yet).",
            value=plan.version if plan is not None else 0,
        )
        phase = g(PLAN_PHASE, "Phase of the newest plan (1 for the current one).", labels=["phase"])
        for phase_name in PLAN_PHASES:
            phase.add_metric([phase_name], 1.0 if pod.relay.phase == phase_name else 0.0)
        yield phase


class SidecarMetrics:
    """The registry of one sidecar, wired to its pod's plan events."""

    def __init__(self, pod: Pod, upstream: Upstream) -> None:
        # No `*_created` series (process-wide), as the controller's exposition: only the
        # counters prometheus_client keeps itself would have one.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(pod, upstream))
        self.phase_seconds = Histogram(
            PLAN_PHASE_SECONDS,
            "Plan phases at the sidecar (prepare: relayed to every rank "
            "prepared; commit: all prepared to every rank committed).",
            ["phase"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.plans = Counter(
            PLANS, "Plans finished at the sidecar, by outcome.", ["outcome"], registry=self.registry
        )
        pod.observers.append(self.on_plan)

    def on_plan(self, event: Event, plan: RelayPlan) -> None:
        if event == "prepared":
            self.phase_seconds.labels("prepare").observe(
                max(0.0, plan.prepared_at - plan.started_at)
            )
        elif event == "committed":
            self.plans.labels("committed").inc()
            if plan.prepared_at:
                self.phase_seconds.labels("commit").observe(
                    max(0.0, plan.finished_at - plan.prepared_at)
                )
        elif event == "aborted":
            self.plans.labels("aborted").inc()
