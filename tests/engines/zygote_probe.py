"""Run by tests/engines/test_zygote.py through the zygote: says what a rank would see."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "probe": os.environ.get("PROBE"),
                "tmp": tempfile.gettempdir(),
                "main": __name__,
                "pid": os.getpid(),
                "ppid": os.getppid(),
            }
        ),
        flush=True,
    )
    print("to stderr", file=sys.stderr, flush=True)
    action = sys.argv[1]
    if action == "sleep":
        time.sleep(600)
    elif action == "raise":
        raise ValueError("a rank failed")
    sys.exit(int(action))
