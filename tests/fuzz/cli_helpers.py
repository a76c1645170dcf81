"""Running `rebalancer.cli.main` in-process and checking how it ended."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout

from hypothesis import event
from hypothesis.control import currently_in_test_context

from rebalancer.cli import main

ERROR_LINE = re.compile(r"^rebalancer( [\w-]+)*: error: \S")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def check_run(argv: list[str], allowed: set[int]) -> tuple[int, str, str]:
    helping = "-h" in argv or "--help" in argv
    if helping:
        allowed = allowed | {0}
    code, out, err = run_cli(argv)
    if currently_in_test_context():
        event(f"exit {code}")
    assert "Traceback" not in err, err
    assert code in allowed, (code, err)
    if code != 0:
        lines = err.rstrip("\n").split("\n")
        assert ERROR_LINE.match(lines[-1]), err
        if len(lines) > 1:  # argparse: usage (with its continuation lines), then the error
            assert lines[0].startswith("usage: ") and all(
                line.startswith(" ") or line == "" for line in lines[1:-1]
            ), err
    elif "--json" in argv and out.strip() and not helping:
        json.loads(out.strip().splitlines()[-1])
    return code, out, err
