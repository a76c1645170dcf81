"""The reliability campaign, short (reliability/chaos/; the long one is in RELIABILITY.md): a real
controller process on an SQLite store, a sidecar per pod, real gloo ranks on real routing
data, every gRPC link through the loopback fault proxy. Each fault kind of the short list
is injected (at least once, at plan phases in turn), and after every episode the store,
the controller and every rank agree again; from the ranks' own step logs every step ran
one version on every rank, outputs equal the unbalanced reference, no rank ran a version
that is not committed, no step waited on the rebalancer; nothing is left running."""

from __future__ import annotations

import pytest

from reliability.chaos import ChaosConfig, Harness, run_chaos
from reliability.chaos.short import short_campaign_failures, short_config

pytestmark = pytest.mark.slow


def test_short_chaos_campaign_keeps_every_invariant() -> None:
    config = short_config()
    result = run_chaos(config)
    assert short_campaign_failures(config, result) == []


def test_sigterm_ends_the_harness_with_nothing_left_behind() -> None:
    """A campaign cut short (a CI timeout, an operator's Ctrl-C or SIGTERM) leaves no
    process, no tmpfs mount and no run folder."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reliability.chaos",
            "--seconds",
            "60",
            "--workers",
            "2",
            "--pods",
            "2",
            "--kinds",
            "latency",
            "--json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        folder = None
        deadline = time.monotonic() + 120
        while folder is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "] up: " in line:
                folder = line.rstrip().rsplit("; ", 1)[-1]
        assert folder is not None and Path(folder).is_dir(), "the harness did not come up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not Path(folder).exists()
    assert folder not in Path("/proc/mounts").read_text()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if folder in cmdline:
            left.append(cmdline)
    assert left == []


def test_a_campaign_that_cannot_start_leaves_nothing_behind() -> None:
    """Set-up failing half way (a hog and the store's tmpfs up, the controller refusing
    its configuration): the error names the cause, and every process started so far is
    reaped, the tmpfs unmounted and the run's folder removed."""
    from pathlib import Path

    config = ChaosConfig(
        seconds=1.0,
        workers=2,
        pods=2,
        kinds=("latency",),
        hog=1,
        prepare_timeout_seconds=-1.0,
        progress=False,
    )
    harness = Harness(config)
    with pytest.raises(
        RuntimeError, match="controller did not start: .*prepare_timeout_seconds must be"
    ):
        harness.run()
    started = harness.procs.all_procs
    assert len(started) == 2 and all(
        p.poll() is not None for p in started
    )  # the hog and the controller
    assert harness.procs.leaked() == []
    assert not harness.tmp.exists()
    assert str(harness.tmp) not in Path("/proc/mounts").read_text()
