"""`rebalancer demo` refuses what it cannot run with exit code 2 and one line, before
starting anything; its help defines the summary; its pods and commit marks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rebalancer.cli import main
from rebalancer.demo import CommitCuts
from rebalancer.launch.config import DemoConfig, default_sidecars, pod_ranks


def exit_code(argv: list[str]) -> int:
    """The CLI's exit code, whether it returns it or argparse exits."""
    try:
        return int(main(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "1"], "need --workers >= 2"),
        (["--slots", "33"], "must be a multiple of --workers"),
        (["--transport", "rdma"], "invalid choice"),
        (["--sidecars", "3"], "--sidecars 3 must be 0 (direct) or divide --workers 4"),
        (["--sidecars", "-1"], "--sidecars -1 must be 0 (direct)"),
        (["--workers", "2", "--sidecars", "4"], "divide --workers 2"),
    ],
)
def test_demo_bad_flags_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert exit_code(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experts", "100000000"], "slots (100000008) must be at most 2048"),
        (["--layers", "100000"], "--layers must be in [1, 1024]"),
        (
            ["--layers", "1000", "--experts", "2000", "--slots", "2000"],
            "--layers x --slots must be at most",
        ),
        (
            ["--controller", "notahost:xx"],
            "controller address 'notahost:xx': port 'xx' is not a number",
        ),
        (["--spare-rows", "-1"], "--spare-rows must be >= 0"),
    ],
)
def test_demo_range_errors_exit_2_before_any_work(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    """Issue 34: these were "out of memory" or a traceback after the workers (or the
    sidecars) had started; a range error is one line and exit 2 before anything runs."""
    import rebalancer.demo

    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the demo started")

    monkeypatch.setattr(rebalancer.demo, "run_demo", started)
    assert exit_code(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rebalancer demo: error: ") and err.count("\n") == 1 and message in err, (
        err
    )


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="enough GPUs for the default 4 workers")
def test_demo_on_cuda_without_a_gpu_per_worker_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda needs one GPU per worker" in err and err.count("\n") == 1


def test_demo_help_defines_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["demo", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "balancedness_first routed balancedness (mean/max GPU load" in out
    assert "averaged over the first 3 windows" in out
    for flag in ("--sidecars", "--keep", "max_output_diff"):
        assert flag in out


def test_pods_default_to_two_when_the_workers_split_evenly() -> None:
    assert [default_sidecars(w) for w in (2, 3, 4, 6, 8)] == [2, 1, 2, 2, 2]
    assert pod_ranks(4, 2) == [range(0, 2), range(2, 4)]
    assert pod_ranks(8, 4)[3] == range(6, 8)
    with pytest.raises(ValueError):
        pod_ranks(4, 3)


def plan(version: int, base: int) -> Any:
    return SimpleNamespace(version=version, base_version=base)


def test_the_window_a_commit_cuts_ran_on_the_old_placement() -> None:
    cuts = CommitCuts()
    # The controller saw the commit before the cut window came in.
    cuts.on_plan("proposed", plan(1, 0))
    cuts.on_plan("prepared", plan(1, 0))
    cuts.on_plan("committed", plan(1, 0))
    assert cuts.cut() == 1 and cuts.base[1] == 0
    # The cut window came in while the plan was still in flight: claimed, not counted twice.
    cuts.on_plan("proposed", plan(2, 1))
    assert cuts.cut() == 2
    cuts.on_plan("committed", plan(2, 1))
    assert cuts.unclaimed is None
    # An aborted plan cuts nothing; a commit left unclaimed is dropped at the next proposal.
    cuts.on_plan("proposed", plan(3, 2))
    cuts.on_plan("aborted", plan(3, 2))
    assert cuts.cut() is None
    cuts.on_plan("proposed", plan(4, 2))
    cuts.on_plan("committed", plan(4, 2))
    cuts.on_plan("proposed", plan(5, 4))
    assert cuts.unclaimed is None and cuts.in_flight == 5


def test_the_workers_time_limit_grows_with_the_windows_asked() -> None:
    """`demo --windows 200` (3,200 steps) stopped after ~1,300 steps at a fixed 110 s and
    exited 0 without a word: the default limit now grows with the steps asked."""
    from rebalancer.launch.config import MIN_TIME_LIMIT, TIME_LIMIT_PER_STEP, DemoConfig, time_limit

    assert time_limit(DemoConfig(steps=200 * 16)) == 200 * 16 * TIME_LIMIT_PER_STEP >= 800
    assert time_limit(DemoConfig(steps=30 * 16)) == max(MIN_TIME_LIMIT, 480 * TIME_LIMIT_PER_STEP)
    assert time_limit(DemoConfig(steps=3200, timeout_seconds=5.0)) == 5.0  # --max-seconds


def test_a_run_cut_short_says_why_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers that ran fewer steps than asked (their time limit ran out): the summary
    says why (`stopped_early`) and the demo exits 1 with that reason on one line."""
    import rebalancer.demo as demo
    from rebalancer.demo import stopped_early
    from rebalancer.launch.config import DemoConfig

    config = DemoConfig(steps=3200, timeout_seconds=140.0)
    assert stopped_early(config, [{"steps": 3200}, {"steps": 3200}]) == ""
    why = stopped_early(config, [{"steps": 1301}, {"steps": 1300}])
    assert (
        why
        == "the workers stopped at step 1300 of 3200: their time limit ran out (--max-seconds 140)"
    )
    seen: list[DemoConfig] = []

    def cut_short(config: DemoConfig, emit: Any = print) -> dict[str, Any]:
        seen.append(config)
        return {
            "plans_committed": 0,
            "max_output_diff": 0.0,
            "ranks_agree_on_versions": True,
            "stopped_early": stopped_early(config, [{"steps": 1300}] * 4),
        }

    monkeypatch.setattr(demo, "run_demo", cut_short)
    assert (
        exit_code(
            ["demo", "--controller", "127.0.0.1:1", "--windows", "200", "--max-seconds", "140"]
        )
        == 1
    )
    assert seen[0].steps == 3200 and seen[0].timeout_seconds == 140.0
    err = capsys.readouterr().err
    assert err == f"rebalancer demo: error: {why}\n"


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf"])
def test_demo_max_seconds_must_be_positive(
    capsys: pytest.CaptureFixture[str], seconds: str
) -> None:
    assert exit_code(["demo", "--max-seconds", seconds]) == 2
    assert "--max-seconds must be a positive number of seconds" in capsys.readouterr().err


def test_the_demo_starts_its_workers_only_once_the_controller_can_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decision process imports for a second or more (longer on a busy machine): the
    demo's workers start only once it answers, or a short demo runs every window before
    the first decision and commits no plan (the wheel's demo test failed so beside a
    4-process CPU hog). Its workers are stopped before they start here: only the order
    is checked, on a real embedded controller."""
    from rebalancer import demo
    from rebalancer.controller.decision_process import DecisionProcess

    order: list[str] = []
    real_wait = DecisionProcess.wait_ready

    def wait_ready(self: DecisionProcess, timeout: float = 120.0) -> None:
        real_wait(self, timeout)
        order.append("the decision process answered")

    @contextlib.contextmanager
    def fleet(config: DemoConfig, address: str, profile: Path, tmp: Path) -> Iterator[list[Any]]:
        order.append("the workers start")
        raise demo.DemoFailed("stopped before the workers (this test)")
        yield []

    monkeypatch.setattr(demo, "demo_fleet", fleet)
    monkeypatch.setattr(DecisionProcess, "wait_ready", wait_ready)
    with pytest.raises(demo.DemoFailed, match="this test"):
        demo.run_demo(DemoConfig(steps=32), emit=lambda line: None)
    # The order, not a probe's timing: a loaded machine answers any probe late (the check
    # asked the ready process again with a 10 ms timeout, and failed beside a CPU hog).
    assert order == ["the decision process answered", "the workers start"]
