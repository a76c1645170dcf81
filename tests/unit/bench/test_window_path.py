"""bench.window_path runs the controller's window path in one process: every window is
ingested and a per-message CPU figure comes out."""

from __future__ import annotations

import json

from bench.window_path import main


def test_every_window_is_ingested_and_timed(capsys) -> None:
    assert main(["--deployments", "2", "--windows", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["messages"] == 2 * 4 * 3 and result["cpu_us_per_message"] > 0
