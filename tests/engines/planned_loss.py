"""The engines' survivor-placement tests, one step shared: wait until every rank holds
the controller's plan for a loss, keep the planned map, stop the controller (or keep it),
and let the ranks go on to the loss (each rank's worker writes `<out>.planned` and waits
for `<out>.go`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rebalancer.controller.embedded import EmbeddedController


def go_once_planned(
    ctl: EmbeddedController,
    tmp_path: Path,
    world: int,
    deployment: str,
    lost: tuple[int, ...],
    planned: list[Any],
    stop_controller: bool = True,
) -> Callable[[], None]:
    """What `_run_ranks(during=...)` runs: appends the controller's planned map for `lost` to
    `planned`; the loss comes with the controller stopped, or up (`stop_controller` False)."""

    def during() -> None:
        markers = [tmp_path / f"rank{r}.json.planned" for r in range(world)]
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not all(m.exists() for m in markers):
            time.sleep(0.2)
        made = ctl.call(lambda: ctl.server.controller.contingency.get(deployment))  # type: ignore[union-attr]
        planned.extend(loss.phy2log for loss in (made.losses if made else ()) if loss.lost == lost)
        if stop_controller:
            ctl.stop()
        for r in range(world):
            (tmp_path / f"rank{r}.json.go").write_text("")

    return during
