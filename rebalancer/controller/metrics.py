"""Prometheus metrics of the controller, on a port of their own.

Two kinds: state read at scrape time from the controller (balancedness,
versions, connected ranks, totals kept in each deployment's stats) through a
custom collector, so nothing is copied on the hot path; and events counted as
they happen (decisions, plan phases and aborts, ingest latency and bytes).
Labels are bounded: deployment, and small fixed sets (outcome, trigger,
phase, reason). Never per expert, per layer or per rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from rebalancer import __version__
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import Decision
from rebalancer.controller.state import Controller


def abort_reason(reason: str) -> str:
    """The bounded label for a plan abort's free-text reason."""
    for key, label in (("timeout", "timeout"), ("disconnected", "disconnect"),
                       ("failed to prepare", "prepare_failed"), ("restarted", "restart")):
        if key in reason:
            return label
    return "other"


class _StateCollector(Collector):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Any]:
        info = InfoMetricFamily("rebalancer_build", "Build of the controller.")
        info.add_metric([], {"version": __version__})
        yield info
        g = GaugeMetricFamily
        bal = g("rebalancer_balancedness", "Mean/max GPU load averaged over layers (1 is perfect).",
                labels=["deployment", "source"])
        imb = g("rebalancer_imbalance_ratio", "Max/mean GPU load of the routed load in the last window.",
                labels=["deployment"])
        version = g("rebalancer_placement_version", "Committed placement version.", labels=["deployment"])
        ranks = g("rebalancer_connected_ranks", "Ranks with an open stream.", labels=["deployment"])
        expected = g("rebalancer_ranks", "Ranks of the deployment's EP group (G).", labels=["deployment"])
        flight = g("rebalancer_plan_in_flight", "1 while a plan is being prepared or committed.",
                   labels=["deployment"])
        paused = g("rebalancer_paused", "1 when automatic rebalancing is paused.", labels=["deployment"])
        c = CounterMetricFamily
        windows = c("rebalancer_windows_ingested", "Windows of counts ingested.", labels=["deployment"])
        dups = c("rebalancer_duplicate_windows", "Resent windows recognised and not counted again.",
                 labels=["deployment"])
        plans = c("rebalancer_plans", "Plans finished, by outcome.", labels=["deployment", "outcome"])
        slots = c("rebalancer_migrated_slots", "Physical slots whose expert changed.", labels=["deployment"])
        moved = c("rebalancer_migrated_bytes", "Expert weight bytes moved by committed plans.",
                  labels=["deployment"])
        for dep in list(self.controller.deployments.values()):
            name, stats = dep.name, dep.stats
            if math.isfinite(stats.balancedness_actual):
                bal.add_metric([name, "actual"], stats.balancedness_actual)
                imb.add_metric([name], 1.0 / max(stats.balancedness_actual, 1e-9))
            if dep.estimator.windows:
                from rebalancer import placement

                est = float(placement.balancedness(dep.phy2log, dep.estimator.estimate(), dep.shape.num_gpus))
                if math.isfinite(est):
                    bal.add_metric([name, "estimated"], est)
            version.add_metric([name], dep.version)
            ranks.add_metric([name], dep.connected_ranks)
            expected.add_metric([name], dep.shape.num_gpus)
            flight.add_metric([name], 1.0 if dep.plan is not None else 0.0)
            paused.add_metric([name], 1.0 if dep.policy.paused else 0.0)
            windows.add_metric([name], stats.windows_ingested)
            dups.add_metric([name], stats.duplicate_windows)
            plans.add_metric([name, "committed"], stats.plans_committed)
            plans.add_metric([name, "aborted"], stats.plans_aborted)
            slots.add_metric([name], stats.slots_moved)
            moved.add_metric([name], stats.bytes_moved)
        yield from (bal, imb, version, ranks, expected, flight, paused, windows, dups, plans, slots, moved)


class ControllerMetrics:
    """The registry of one controller, wired to its observers."""

    def __init__(self, controller: Controller) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(controller))
        r = self.registry
        self.decisions = Counter("rebalancer_decisions", "Decisions taken, by outcome.",
                                 ["deployment", "outcome"], registry=r)
        self.rebalances = Counter("rebalancer_rebalances", "Plans started, by trigger.",
                                  ["deployment", "trigger"], registry=r)
        self.aborts = Counter("rebalancer_plan_aborts", "Plans aborted, by reason.",
                              ["deployment", "reason"], registry=r)
        self.phase_seconds = Histogram(
            "rebalancer_plan_phase_seconds", "Duration of plan phases (prepare: proposed to all "
            "prepared; commit: all prepared to first commit confirmed).", ["phase"], registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.ingest_seconds = Histogram(
            "rebalancer_ingest_seconds", "Decode, validate and merge time of one window.", registry=r,
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self.ingest_bytes = Counter("rebalancer_ingest_bytes", "Bytes of count arrays ingested.",
                                    ["deployment"], registry=r)
        self.ingest_refused = Counter("rebalancer_ingest_refused", "Windows refused as bad input.",
                                      ["deployment"], registry=r)
        self._started: dict[tuple[str, int], float] = {}
        controller.observers.plan.append(self.on_plan)
        controller.observers.decision.append(self.on_decision)

    def on_decision(self, deployment: str, decision: Decision, trigger: str) -> None:
        self.decisions.labels(deployment, decision.outcome).inc()

    def on_plan(self, deployment: str, plan: Plan, what: str) -> None:
        if what == "proposed":
            self.rebalances.labels(deployment, plan.trigger).inc()
        elif what == "prepared" and plan.prepared_at:
            self.phase_seconds.labels("prepare").observe(max(0.0, plan.prepared_at - plan.started_at))
        elif what == "committed" and plan.committed_at and plan.prepared_at:
            self.phase_seconds.labels("commit").observe(max(0.0, plan.committed_at - plan.prepared_at))
        elif what == "aborted":
            self.aborts.labels(deployment, abort_reason(plan.reason)).inc()

    def on_ingest(self, deployment: str, nbytes: int, seconds: float) -> None:
        self.ingest_bytes.labels(deployment).inc(nbytes)
        self.ingest_seconds.observe(seconds)
