"""bench.scrape times whole scrapes of a fleet's exposition in one process: the first
(computing every deployment's estimated balancedness) apart from the ones after it."""

from __future__ import annotations

import json

from bench.scrape import main


def test_a_fleet_is_scraped_and_timed(capsys) -> None:
    assert main(["--deployments", "3", "--pool-size", "2", "--scrapes", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["deployments"] == 3 and result["bytes"] > 3 * 2000  # ~50 series each
    assert result["first_scrape_cpu_seconds"] >= 0 and len(result["scrape_cpu_seconds_range"]) == 2


def test_bad_sizes_are_refused_with_one_line(capsys) -> None:
    assert main(["--deployments", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
