"""The chaos campaign's fault kinds and timeline (reliability/chaos/): one registry of kinds by
name gives the CLI's `--kinds`, the schedule and the weights; and a seed draws the same
fault sequence as the campaign's recorded runs (RELIABILITY.md's seeds keep their meaning:
the draws below were recorded from the harness before it was split into a package)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from reliability.chaos import (
    ALL_KINDS,
    FAULTS,
    LINK_FAULTS,
    NODE_FAULTS,
    PROCESS_FAULTS,
    STORE_FAULTS,
    faults,
    schedule,
)
from reliability.chaos.__main__ import main
from reliability.chaos.checks import Outcome
from reliability.chaos.config import ChaosConfig
from reliability.chaos.short import SHORT_KINDS
from reliability.faultproxy import FaultProxy

# The order the kinds are shuffled from: a seed's sequence depends on it.
RECORDED_KINDS = (
    "sigkill_worker",
    "sigterm_worker",
    "sigstop_worker",
    "sigkill_sidecar",
    "sigterm_sidecar",
    "sigstop_sidecar",
    "sigkill_controller",
    "sigterm_controller",
    "sigstop_controller",
    "latency",
    "bandwidth",
    "drop",
    "half_open",
    "blackhole",
    "store_readonly",
    "store_disk_full",
    "store_torn_wal",
    "cpu_starve",
)


def test_every_kind_is_registered_once_in_the_recorded_order() -> None:
    assert ALL_KINDS == RECORDED_KINDS == tuple(FAULTS)
    assert PROCESS_FAULTS + LINK_FAULTS + STORE_FAULTS + NODE_FAULTS == ALL_KINDS
    assert LINK_FAULTS == ("latency", "bandwidth", "drop", "half_open", "blackhole")
    # A killed worker restarts its whole group: the costliest episode comes least often.
    assert faults.WEIGHTS == {k: 1.0 for k in ALL_KINDS} | {
        "sigkill_worker": 0.35,
        "sigterm_worker": 0.35,
    } | {k: 2.0 for k in LINK_FAULTS}


def test_a_kind_registered_twice_is_refused() -> None:
    before = dict(FAULTS)
    with pytest.raises(ValueError, match="drop registered twice"):
        faults.fault("link", "drop")(faults.link)
    assert FAULTS == before


def test_the_cli_refuses_an_unknown_kind_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kinds", "latency,nope", "--quiet"]) == 2
    assert capsys.readouterr().err == "error: unknown fault kinds ['nope']\n"


@pytest.mark.parametrize(
    ("seed", "kinds", "first"),
    [
        (
            11,
            SHORT_KINDS,
            [
                "sigkill_worker",
                "bandwidth",
                "sigkill_controller",
                "drop",
                "store_disk_full",
                "latency",
                "sigterm_sidecar",
                "sigstop_controller",
                "store_torn_wal",
                "cpu_starve",
                "blackhole",
                "half_open",
            ],
        ),
        (
            12,
            SHORT_KINDS,
            [
                "store_torn_wal",
                "store_disk_full",
                "sigterm_sidecar",
                "drop",
                "cpu_starve",
                "sigkill_controller",
                "sigstop_controller",
                "sigkill_worker",
                "bandwidth",
                "blackhole",
                "latency",
                "half_open",
            ],
        ),
        (
            13,
            SHORT_KINDS,
            [
                "blackhole",
                "half_open",
                "sigkill_controller",
                "store_disk_full",
                "bandwidth",
                "sigterm_sidecar",
                "drop",
                "store_torn_wal",
                "sigstop_controller",
                "sigkill_worker",
                "cpu_starve",
                "latency",
            ],
        ),
        (
            14,
            ALL_KINDS,
            [
                "sigstop_worker",
                "sigstop_controller",
                "bandwidth",
                "sigkill_worker",
                "sigkill_controller",
                "cpu_starve",
                "sigstop_sidecar",
                "latency",
                "blackhole",
                "store_disk_full",
                "sigterm_worker",
                "half_open",
                "store_readonly",
                "drop",
                "sigterm_sidecar",
                "sigterm_controller",
                "store_torn_wal",
                "sigkill_sidecar",
            ],
        ),
    ],
)
def test_a_seed_gives_every_kind_its_turn_in_the_recorded_order(
    seed: int, kinds: tuple[str, ...], first: list[str]
) -> None:
    assert schedule.first_turns(random.Random(seed), kinds) == first


def test_after_the_first_turns_kinds_come_by_weight_as_recorded() -> None:
    rng = random.Random(14)
    schedule.first_turns(rng, ALL_KINDS)
    assert [schedule.next_kind(rng, ALL_KINDS) for _ in range(6)] == [
        "store_disk_full",
        "sigstop_controller",
        "blackhole",
        "latency",
        "half_open",
        "bandwidth",
    ]


def test_every_seventh_episode_strikes_at_any_moment_the_others_at_each_phase_in_turn() -> None:
    assert [schedule.phase_of(i) for i in range(8)] == [
        "proposed",
        "preparing",
        "prepared",
        "commit_sent",
        "commit_agreed",
        "switched",
        "any",
        "preparing",
    ]


def test_seed_11_first_episode_draws_its_link_faults_as_recorded(tmp_path: Path) -> None:
    """Episode 0 of the short campaign's seed 11: the storm beside it and each link fault's
    link, length and amount, started on a real fault proxy; then the worker kill's rank."""
    proxy = FaultProxy()
    try:
        proxy.add("controller", "127.0.0.1:0", "127.0.0.1:9")
        for pod in range(2):
            proxy.add(
                f"pod{pod}",
                f"unix://{tmp_path}/pod{pod}.sock",
                f"unix://{tmp_path}/agent{pod}.sock",
            )
        said: list[str] = []
        harness = SimpleNamespace(
            rng=random.Random(11), proxy=proxy, out=Outcome(), say=said.append
        )
        assert schedule.first_turns(harness.rng, SHORT_KINDS)[0] == "sigkill_worker"
        storm = schedule.storm(harness.rng, SHORT_KINDS)
        assert storm == ["bandwidth", "latency"]
        seconds = [faults.link_fault(harness, kind) for kind in storm]  # type: ignore[arg-type]
        assert seconds == [1.6763957084242018, 1.969728815357923]
        assert said == [
            "bandwidth on link pod1 for 1.7s (2000)",
            "latency on link pod1 for 2.0s (0.484141)",
        ]
        assert proxy.links["pod1"].state.bytes_per_second == 2000.0
        assert proxy.links["pod1"].state.latency == 0.484141001506505
        assert harness.out.faults == {"bandwidth": 1, "latency": 1}
        assert harness.rng.randrange(2) == 0  # the rank sigkill_worker kills
    finally:
        proxy.heal()
        proxy.close()


def test_a_short_run_that_cannot_start_is_a_failed_run_and_the_campaign_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One seed whose harness raised (a port taken, a worker that never came up) used to end
    the whole campaign; it is recorded as failed and the next seed runs."""
    import reliability.chaos.short as short

    def run(config: ChaosConfig) -> dict[str, object]:
        if config.seed == 5:
            raise OSError("address already in use")
        return {
            "invariant_violations": 0,
            "violations": [],
            "leaked_processes": 0,
            "faults_by_kind": dict.fromkeys(SHORT_KINDS, 1),
            "controller_restarts": 2,
            "group_restarts": 1,
            "controller_recovery_seconds_p99": 1.0,
            "max_step_wait_ms": 1.0,
            "steps_logged": 3,
            "plans_committed": 1,
            "plans_aborted": 0,
            "transfer_timeouts": 0,
        }

    monkeypatch.setattr(short, "run_chaos", run)
    out = tmp_path / "runs.jsonl"
    assert short.main(["--first", "4", "--count", "3", "--out", str(out)]) == 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["seed"], line["pass"]) for line in lines] == [(4, True), (5, False), (6, True)]
    assert lines[1]["failures"] == ["run did not complete: OSError: address already in use"]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
        "runs": 3,
        "passed": 2,
        "hog": 0,
    }
