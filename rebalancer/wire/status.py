"""How a status field reads: what `rebalancer admin status` and the demo's status line
show for a value the AdminService sends."""

from __future__ import annotations


def balancedness_text(value: float, missing: str) -> str:
    """A balancedness as status shows it: 0 on the wire means none yet (a measured one
    is mean / max load of a window with load, above 0)."""
    return f"{value:.3f}" if value > 0 else f"- ({missing})"
