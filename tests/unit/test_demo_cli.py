"""`rebalancer demo` refuses what it cannot run with exit code 2 and one line, before
starting anything; its help defines the summary; its pods and commit marks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rebalancer.cli import main
from rebalancer.demo import CommitCuts, default_sidecars, pod_ranks


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
def test_demo_bad_flags_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert exit_code(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


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
