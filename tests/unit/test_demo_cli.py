"""`rebalancer demo` refuses what it cannot run with exit code 2 and one line, before
starting anything."""

from __future__ import annotations

import pytest
import torch

from rebalancer.cli import main


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
