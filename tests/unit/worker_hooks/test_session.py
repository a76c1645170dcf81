"""The engine-neutral rank session (worker_hooks/session/) the SGLang and vLLM adapters
build on: its windows, plan book, agreement and plan handlers, on a real `WorkerAgent`
that is never started (what it queued is read back) and a one-rank gloo group. The
engines' own tests (tests/engines/) drive the same code under SGLang's and vLLM's real
code with several ranks."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import worker_hooks
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from worker_hooks.config import WindowConfig
from worker_hooks.session import windows
from worker_hooks.session.agreement import NO_PLAN, plan_digest
from worker_hooks.session.book import PlanBook
from worker_hooks.session.rank import RankSession, SessionStats, worker_identity
from worker_hooks.session.windows import CountWindows

L, P, E = 2, 4, 3
START = np.array([[0, 1, 2, 0], [2, 1, 0, 1]], dtype=np.int64)
PLAN = np.array([[0, 1, 2, 2], [2, 1, 0, 0]], dtype=np.int64)


class Settings:
    """What an engine adapter's config gives the session (session.rank.LinkSettings)."""

    link = Link("localhost:1", deployment="d", worker_id="w")
    windows = WindowConfig(steps=4)


def session() -> RankSession:
    shape = ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=1, num_nodes=1)
    return RankSession(Settings(), 0, shape, START, SessionStats())


def windows_of(s: RankSession) -> list[tuple[int, int, int, list, list | None]]:
    return [
        (
            w.first_step,
            w.num_steps,
            w.version,
            w.logical.tolist(),
            None if w.physical is None else w.physical.tolist(),
        )
        for w in s.agent._pending.take()
    ]


def reports_of(s: RankSession) -> list[tuple[int, int, str]]:
    return [(r.version, r.phase, r.error) for r in s.agent._reports]


def prepare(version: int, base: int, phy2log: np.ndarray) -> pb.Prepare:
    return pb.Prepare(
        version=version,
        base_version=base,
        placement=pb.Placement(version=version, phy2log=codec.encode(phy2log.astype(np.int32))),
    )


@pytest.fixture
def one_rank_group() -> object:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def test_plan_digest_tells_plans_and_versions_apart() -> None:
    other = PLAN.copy()
    other[0, [0, 1]] = other[0, [1, 0]]
    assert plan_digest(1, PLAN) == plan_digest(1, PLAN.astype(np.int32))
    assert plan_digest(1, PLAN) != plan_digest(1, other)
    assert plan_digest(1, PLAN) != plan_digest(2, PLAN)
    assert 0 < plan_digest(1, PLAN) < 2**63 and plan_digest(1, PLAN) != NO_PLAN


def test_the_book_offers_a_committed_plan_only_once_its_map_is_staged() -> None:
    book = PlanBook()
    book.commit(3)
    assert book.ready(serving=1) == 1  # committed, not staged here
    book.stage(2, START, serving=1)
    book.stage(3, PLAN, serving=1)
    assert book.ready(serving=1) == 3 and 2 in book
    book.stage(4, PLAN, serving=3)  # the rank serves v3 now: v2 and v3 can never be switched to
    assert 2 not in book and 3 not in book and book.ready(serving=3) == 3
    book.drop(4)
    assert book.take(4) is None


def test_a_plan_staged_alone_replaces_every_other() -> None:
    """The project's hook stages one plan's weights at a time (worker_hooks/plans.py): a
    newer plan staged replaces an older one not yet switched to, so the older can no
    longer be offered (its weights are gone)."""
    book = PlanBook()
    book.stage(2, START, serving=1)
    book.commit(2)
    book.stage(3, PLAN, serving=1, alone=True)
    assert 2 not in book and len(book) == 1 and book.ready(serving=1) == 1
    book.commit(3)
    assert book.ready(serving=1) == 3


def test_windows_close_per_placement_and_an_empty_window_stays_open() -> None:
    s = session()
    w = CountWindows(s.agent, E, divide_by=2)
    w.close(3, 0, START)  # nothing counted yet: the window stays open from step 0
    w.add(torch.tensor([[2, 4, 6, 8], [1, 1, 1, 1]]))
    w.add(torch.tensor([[2, 0, 0, 0], [1, 1, 1, 1]]))
    w.close(5, 0, START)
    w.add(torch.tensor([[0, 0, 2, 2], [4, 0, 0, 0]]))
    w.close(7, 1, PLAN, mixed=True)
    assert windows_of(s) == [
        (0, 5, 0, [[6, 2, 3], [1, 2, 1]], [[2, 2, 3, 4], [1, 1, 1, 1]]),  # halved: counted twice
        (5, 2, 1, [[0, 0, 2], [0, 0, 2]], None),  # a map no version names: logical counts only
    ]
    assert (w.sent, w.tokens_sent) == (2, 19)


def test_an_empty_slot_holds_no_expert_in_the_counts() -> None:
    s = session()
    w = CountWindows(s.agent, E)
    w.add(torch.tensor([[5, 1, 9, 7], [0, 0, 0, 3]]))
    w.close(1, 0, np.array([[0, 1, -1, 0], [2, 1, 0, -1]]))
    assert windows_of(s)[0][3] == [[12, 1, 0], [0, 0, 0]]


def test_prepare_commit_abort_on_the_session() -> None:
    s = session()
    s.on_prepare(prepare(1, 0, PLAN))
    s.on_prepare(prepare(2, 5, PLAN))  # on another version than the one served
    s.on_prepare(prepare(3, 0, np.zeros((L, P), dtype=np.int64)))  # expert 1 and 2 held nowhere
    s.on_commit(1)
    assert s.plans.ready(s.version) == 1
    s.on_abort(1, "a peer failed")
    assert s.plans.ready(s.version) == 0 and s.stats.aborted == 1
    phases = reports_of(s)
    assert [(v, p) for v, p, _ in phases] == [
        (1, pb.PLAN_PHASE_PREPARED),
        (2, pb.PLAN_PHASE_FAILED),
        (3, pb.PLAN_PHASE_FAILED),
        (1, pb.PLAN_PHASE_ABORTED),
    ]
    assert "based on v5, rank serves v0" in phases[1][2]
    s.stopped(1, "layer group 1 failed")  # half-way after a commit: no more plans
    s.on_prepare(prepare(4, 0, PLAN))
    assert "rank stopped taking plans (layer group 1 failed)" in reports_of(s)[-1][2]


def test_a_switch_is_agreed_only_on_the_map_the_plan_was_built_on(one_rank_group: object) -> None:
    s = session()
    s.on_prepare(prepare(1, 0, PLAN))
    s.on_commit(1)
    refused = s.agree_switch(PLAN, one_rank_group)  # the engine serves another map than v1's base
    assert (refused.agreed, refused.plan) == (1, None) and "another map" in refused.refused
    assert reports_of(s)[-1][:2] == (1, pb.PLAN_PHASE_FAILED) and 1 not in s.plans
    s.on_prepare(prepare(2, 0, PLAN))
    s.on_commit(2)
    switch = s.agree_switch(START, one_rank_group)
    assert switch.agreed == 2 and np.array_equal(switch.plan, PLAN) and not switch.refused
    s.made_live(2, PLAN)
    assert s.version == 2 and s.stats.commits == [(0, 2)] and np.array_equal(s.phy2log, PLAN)
    assert s.agree_switch(PLAN, one_rank_group).plan is None  # nothing newer: no switch, no report
    assert reports_of(s)[-1][:2] == (2, pb.PLAN_PHASE_COMMITTED)


def test_the_worker_identity_carries_the_pid() -> None:
    import os

    assert worker_identity(Settings.link) == f"w pid {os.getpid()}"


def test_the_window_close_rule_has_one_home() -> None:
    """When a window is due is decided in one function (worker_hooks/session/windows.py
    `window_due`) for the hook and every engine adapter: no other comparison of a step
    count against the window's steps in the worker side."""
    rule = re.compile(
        r"(>=|<=|>|<)\s*[\w.]*(window_steps|windows\.steps)\b|(window_steps|windows\.steps)\s*(>=|<=|>|<)"
    )
    root = Path(worker_hooks.__file__).parent
    offenders = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path != Path(windows.__file__)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if rule.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == [], "a second window close rule:\n" + "\n".join(offenders)
