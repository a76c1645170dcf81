"""A model of the plan protocol explored with loss, duplication, reordering and restarts.

The controller is the real one (`Controller` on a real SQLite file, reopened on a
restart); the ranks, their links and (with `grouped`) the pod's sidecar are modelled:
a rank stages a plan on Prepare when it serves the plan's base, marks it ready on
Commit, and the group switches when every rank holds it ready (the commit agreement,
worker_hooks/agree.py, taken as one atomic step); each switch is reported COMMITTED.
Every message either way can be dropped, delivered twice or out of order; a session's
link can drop (the controller ends it) and come back (Register, then its stream); the
controller can restart on its store; the whole group can restart on the stored
committed placement. Windows state what their ranks serve (version and digest), a
sidecar's by the sidecar's own rule (`Pod.statement`), and old windows are resent late.

Checked after every step: the ranks never serve a version whose Commit the controller
did not send (no rank switches on its own), all ranks serve one version (no mixed maps),
and the store's committed version never goes back while the ranks run (nothing committed
is forgotten). Checked at the end, after the faults stop and every report still queued is
lost: within a bounded number of rounds (windows sent, ticks past the commit grace) the
controller and the store hold the version the ranks serve.

`test_without_the_rule_the_model_finds_a_divergence` removes the reconciliation rule
(`Plans.serving` only notes statements) and expects hypothesis to find a run that never
converges: the test that shows the model can fail."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from rebalancer.controller.coordinate import COMMIT_GRACE_SECONDS
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.plans import Plans
from rebalancer.controller.registry import REREGISTER_SECONDS
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import InputError, StateError
from rebalancer.sidecar.pod import Pod
from rebalancer.wire.layout import placement_digest
from tests.unit.controller.test_controller import SHAPE, FakeClock

POLICY = PolicyConfig(paused=True, min_windows=1, prepare_timeout_seconds=5.0)
G = SHAPE.num_gpus
SETTLE_ROUNDS = 4  # the bound: rounds of windows and ticks after the faults stop
STEPS = {"steps": 0, "runs": 0}  # explored, for the report (printed with -s)
# The events a step draws from; repeated ones are drawn more often. A plan's path comes
# first: hypothesis draws low indices more often, and runs should reach every phase.
ACTIONS = (
    ["down_all", "up_all", "force", "agreement:lost", "agreement"] * 2
    + ["window"] * 2
    + ["resend_an_old_window"]
    + [f"controller_message:{w}" for w in ("deliver", "drop", "twice")]
    + [f"report:{w}" for w in ("deliver", "drop", "twice")]
    + [
        "tick:0.5",
        "tick:3",
        "tick:12",
        "link_drops",
        "links_come_back",
        "controller_restarts",
        "group_restarts",
    ]
)


@dataclass
class Link:
    """One session: a rank alone, or (grouped) the pod's sidecar for every rank."""

    ranks: tuple[int, ...]
    session_id: str = ""
    down: list[tuple[str, int, int, Any]] = field(default_factory=list)  # controller -> ranks
    up: list[tuple[int, str]] = field(default_factory=list)  # reports to the controller
    sent: list[tuple[int, tuple[int, int]]] = field(default_factory=list)  # (seq, statement) sent
    next_seq: int = 0


class PlanProtocol(RuleBasedStateMachine):
    grouped = False  # one session for both ranks (a pod's sidecar), else one per rank
    committing = False  # start with a plan's Commit held by every rank

    def __init__(self) -> None:
        super().__init__()
        STEPS["runs"] += 1
        self.folder = Path(tempfile.mkdtemp(prefix="plan-model-"))
        self.clock = FakeClock(1000.0)
        self.ctl = Controller(Store(self.folder / "c.sqlite"), POLICY, clock=self.clock)
        self.placements: dict[int, np.ndarray] = {}  # what ranks learnt from Prepare / Register
        self.committed_sent: set[int] = {0}
        self.served = [0] * G
        self.staged: list[set[int]] = [set() for _ in range(G)]
        self.ready: list[set[int]] = [set() for _ in range(G)]
        self.links = [Link((0, 1))] if self.grouped else [Link((r,)) for r in range(G)]
        self.rng = np.random.default_rng(0)
        self.floor = 0  # the store's committed version may not go below it while ranks run
        for link in self.links:
            self._connect(link)
        self.placements[0] = self.ctl.deployment("d").phy2log.copy()
        for link in self.links:  # counts folded, so that a forced plan can start at once
            self._window(link)
        if (
            self.committing
        ):  # a forced plan whose Commit every rank holds: the runs go on from there
            link = self.links[0]
            for each in (self.force, self.down_all, self.up_all, self.down_all):
                each(link, 0)
            assert self.ready[0], "the set-up did not reach the commit"

    # ------------------------------------------------------------ plumbing

    def _connect(self, link: Link) -> None:
        version = min(self.served[r] for r in link.ranks)
        try:
            session, dep = self.ctl.register(
                "d",
                link.ranks if self.grouped else link.ranks[0],
                SHAPE,
                version,
                None,
                f"w{link.ranks}",
                pod="p" if self.grouped else "",
            )
        except StateError:
            return  # refused: the link stays down, it tries again later
        link.session_id, link.next_seq = session.session_id, dep.windows.expected(session.ranks)
        link.down.clear()

        def send(kind: str, plan: Any, link: Link = link) -> None:
            if kind == "planned_loss":
                return  # survivor placements told ahead: not part of the plan protocol
            if kind == "commit":
                self.committed_sent.add(plan.version)
            link.down.append(
                (
                    kind,
                    plan.version,
                    getattr(plan, "base_version", 0),
                    getattr(plan, "phy2log", None),
                )
            )

        self.ctl.attach(session.session_id, send)

    def _disconnect(self, link: Link) -> None:
        if link.session_id:
            self.ctl.detach(link.session_id)
        link.session_id = ""
        link.down.clear()
        link.up.clear()

    def _statement(self, link: Link) -> tuple[int, int]:
        said = {
            r: (self.served[r], placement_digest(self.placements[self.served[r]]))
            for r in link.ranks
        }
        if not self.grouped:
            return said[link.ranks[0]]
        return Pod.statement(SimpleNamespace(statements=said, ranks=link.ranks))  # type: ignore[arg-type]

    def _deliver_down(self, link: Link, index: int) -> None:
        kind, version, base, phy2log = link.down[index]
        for r in link.ranks:
            if kind == "prepare":
                if phy2log is not None:
                    self.placements.setdefault(version, phy2log.copy())
                if self.served[r] == base:
                    self.staged[r].add(version)
                    if r == link.ranks[-1]:
                        link.up.append((version, "prepared"))
                else:
                    link.up.append((version, "failed"))
            elif kind == "commit" and version in self.staged[r]:
                self.ready[r].add(version)
            elif kind == "abort" and version not in self.ready[r]:
                self.staged[r].discard(version)

    def _deliver_up(self, link: Link, index: int) -> None:
        version, phase = link.up[index]
        if not link.session_id:
            return
        try:
            self.ctl.report(link.session_id, version, phase)
        except (StateError, InputError):
            pass  # refused: a refusal is logged by the sender and dropped

    def _window(self, link: Link) -> None:
        if not link.session_id:
            return
        dep = self.ctl.deployment("d")
        counts = self.rng.integers(1, 50, size=(SHAPE.num_layers, SHAPE.num_logical))
        statement = self._statement(link)
        ranks: Any = link.ranks if self.grouped else link.ranks[0]
        self.ctl.ingest(dep, ranks, link.next_seq, statement[0], counts, None, statement)
        link.sent.append((link.next_seq, statement))
        link.next_seq += 1

    def _switch(self) -> None:
        common = set.intersection(*self.ready)
        ahead = [v for v in common if v > self.served[0]]
        if not ahead:
            return
        version = max(ahead)
        for r in range(G):
            self.served[r] = version
            self.staged[r] = {v for v in self.staged[r] if v > version}
            self.ready[r] = {v for v in self.ready[r] if v > version}
        for link in self.links:
            link.up.append((version, "committed"))

    def _tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.ctl.tick()

    # ------------------------------------------------------------ the rules

    @rule(action=st.sampled_from(ACTIONS), i=st.integers(0, 1), pick=st.integers(0, 99))
    def step(self, action: str, i: int, pick: int) -> None:
        """One event, drawn by weight (ACTIONS): a plan's progress is common enough that
        runs reach every phase before a fault, as the chaos campaign's episodes do."""
        STEPS["steps"] += 1
        link = self.links[i % len(self.links)]
        getattr(self, action.split(":")[0])(link, pick, *action.split(":")[1:])

    def window(self, link: Link, pick: int) -> None:
        self._window(link)

    def resend_an_old_window(self, link: Link, pick: int) -> None:
        """A window the controller counted, resent late with what it stated then."""
        if not link.session_id or not link.sent:
            return
        seq, statement = link.sent[pick % len(link.sent)]
        ranks: Any = link.ranks if self.grouped else link.ranks[0]
        counts = np.ones((SHAPE.num_layers, SHAPE.num_logical), dtype=np.int64)
        try:
            self.ctl.ingest(
                self.ctl.deployment("d"), ranks, seq, statement[0], counts, None, statement
            )
        except (StateError, InputError):
            # Refused (a seq past the cursor a restarted controller restored: a gap): the
            # service ends the stream and the session (service.py), changing nothing else.
            self._disconnect(link)

    def force(self, link: Link, pick: int) -> None:
        if any(link.session_id for link in self.links):
            try:
                self.ctl.force("d")
            except (StateError, InputError):
                pass

    def down_all(self, link: Link, pick: int) -> None:
        """A calm moment on the way down: every controller message delivered in order."""
        for each in self.links:
            while each.down:
                self._deliver_down(each, 0)
                each.down.pop(0)

    def up_all(self, link: Link, pick: int) -> None:
        """A calm moment on the way up: every queued report delivered in order."""
        for each in self.links:
            while each.up:
                self._deliver_up(each, 0)
                each.up.pop(0)

    def controller_message(self, link: Link, pick: int, what: str) -> None:
        """One controller message, any of those queued (reordered): delivered, dropped,
        or delivered and kept to come again (duplicated)."""
        if not link.down:
            return
        index = pick % len(link.down)
        if what != "drop":
            self._deliver_down(link, index)
        if what != "twice":
            link.down.pop(index)

    def report(self, link: Link, pick: int, what: str) -> None:
        if not link.up:
            return
        index = pick % len(link.up)
        if what != "drop":
            self._deliver_up(link, index)
        if what != "twice":
            link.up.pop(index)

    def agreement(self, link: Link, pick: int, lost: str = "") -> None:
        """The ranks' agreement; `lost`: the COMMITTED reports of the switch never reach the
        controller (refused for a session the controller had ended, or queued on a sidecar
        that is killed: the edge the chaos campaign lost)."""
        before = [len(each.up) for each in self.links]
        self._switch()
        if lost:
            for each, n in zip(self.links, before, strict=True):
                del each.up[n:]

    def tick(self, link: Link, pick: int, seconds: str) -> None:
        self._tick(float(seconds))

    def link_drops(self, link: Link, pick: int) -> None:
        self._disconnect(link)

    def links_come_back(self, link: Link, pick: int) -> None:
        self._tick(REREGISTER_SECONDS)
        for each in self.links:
            if not each.session_id:
                self._connect(each)

    def controller_restarts(self, link: Link, pick: int) -> None:
        for each in self.links:
            each.session_id = ""
            each.down.clear()
            each.up.clear()
        self.ctl.store.close()
        self.ctl = Controller(Store(self.folder / "c.sqlite"), POLICY, clock=self.clock)

    def group_restarts(self, link: Link, pick: int) -> None:
        """Every rank restarts on the committed placement the store holds."""
        for each in self.links:
            self._disconnect(each)
        row = next(d for d in self.ctl.store.load_deployments() if d.name == "d")
        self.placements.setdefault(row.committed_version, row.phy2log.copy())
        self.served = [row.committed_version] * G
        self.staged = [set() for _ in range(G)]
        self.ready = [set() for _ in range(G)]
        self.floor = 0
        self._tick(REREGISTER_SECONDS)
        for each in self.links:
            self._connect(each)

    # ------------------------------------------------------------ the checks

    @invariant()
    def ranks_serve_only_what_was_committed_and_all_the_same(self) -> None:
        assert len(set(self.served)) == 1, f"mixed maps: {self.served}"
        assert self.served[0] in self.committed_sent or self.served[0] == self.floor_version()

    def floor_version(self) -> int:
        return next(d.committed_version for d in self.ctl.store.load_deployments() if d.name == "d")

    @invariant()
    def nothing_committed_is_forgotten(self) -> None:
        stored = self.floor_version()
        assert stored >= self.floor, f"the store went back from v{self.floor} to v{stored}"
        self.floor = stored

    def teardown(self) -> None:
        try:
            self._settle()
        finally:
            self.ctl.store.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _settle(self) -> None:
        """The faults stop; every report still queued was lost. Within SETTLE_ROUNDS rounds
        of windows and ticks the controller and the store hold what the ranks serve."""
        for link in self.links:
            link.up.clear()
        self._tick(REREGISTER_SECONDS)
        for link in self.links:
            if not link.session_id:
                self._connect(link)
        for _ in range(SETTLE_ROUNDS):
            for link in self.links:
                while link.down:
                    self._deliver_down(link, 0)
                    link.down.pop(0)
            self._switch()
            for link in self.links:
                while link.up:
                    self._deliver_up(link, 0)
                    link.up.pop(0)
                self._window(link)
            self._tick(POLICY.prepare_timeout_seconds + COMMIT_GRACE_SECONDS + 1)
        dep = self.ctl.deployment("d")
        assert all(link.session_id for link in self.links), "a link never came back"
        assert dep.version == self.served[0], f"controller v{dep.version}, ranks v{self.served[0]}"
        assert self.floor_version() == self.served[0], (
            f"store v{self.floor_version()}, ranks v{self.served[0]}"
        )


def test_a_window_resent_past_a_restored_cursor_ends_the_link_and_the_run_converges() -> None:
    """Found by the exploration: windows 1 and 2 counted, the controller restarts on a
    cursor that had not stored them, the links come back (numbering from 1), and window 2
    of the old session arrives late. The controller refuses it (a gap) and ends that
    session; the run still converges once the link is back."""
    for machine in (PlanProtocol(), GroupedPlanProtocol()):
        link = machine.links[0]
        machine.window(link, 0)
        machine.window(link, 0)
        machine.controller_restarts(link, 0)
        machine.links_come_back(link, 0)
        assert link.sent[-1][0] > link.next_seq  # the late window is past the cursor
        machine.resend_an_old_window(link, len(link.sent) - 1)
        assert not link.session_id, "the refused window ended its session"
        machine.teardown()  # converges: the link registers again, the checks hold


class GroupedPlanProtocol(PlanProtocol):
    grouped = True


class CommittingPlanProtocol(PlanProtocol):
    committing = True


class CommittingGroupedPlanProtocol(PlanProtocol):
    grouped = committing = True


MODEL_SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
MACHINES = [
    PlanProtocol,
    GroupedPlanProtocol,
    CommittingPlanProtocol,
    CommittingGroupedPlanProtocol,
]


@pytest.mark.parametrize(
    "machine", MACHINES, ids=["ranks", "sidecar", "ranks-committing", "sidecar-committing"]
)
def test_the_controller_converges_to_what_the_ranks_serve(machine: type[PlanProtocol]) -> None:
    STEPS["steps"] = STEPS["runs"] = 0
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)
    print(f"\n{machine.__name__}: {STEPS['runs']} runs, {STEPS['steps']} steps explored")
    assert STEPS["steps"] > 600  # the exploration ran, not a handful of steps


def test_without_the_rule_the_model_finds_a_divergence(monkeypatch: pytest.MonkeyPatch) -> None:
    def noted_only(
        self: Plans, dep: Any, ranks: tuple[int, ...], version: int, digest: int
    ) -> None:
        dep.state_serving(ranks, version, digest)

    monkeypatch.setattr(Plans, "serving", noted_only)
    with pytest.raises(AssertionError, match="controller v|store v"):
        run_state_machine_as_test(
            CommittingPlanProtocol,
            settings=settings(
                MODEL_SETTINGS,
                max_examples=200,
                stateful_step_count=8,
                phases=[Phase.generate],
                derandomize=True,
            ),
        )
