"""SGLang plugin: SGLang's EPLB driven by the rebalancer's controller, no SGLang patch.

Installed with `pip install moe-rebalancer[sglang]`, SGLang finds `register` through
its plugin entry point (`sglang.srt.plugins`) in every process it starts. With
`--enable-eplb` and `REBALANCER_ADDRESS` set (the pod's sidecar socket or the
controller; `worker_hooks/engines/sglang/config.py` lists the other variables), each rank

* streams the counts SGLang's own recorder gathers (`_StatAccumulator.append`, one
  `[L, P]` physical count per forward pass) to the controller every
  `REBALANCER_WINDOW_STEPS` passes, as the project's own hooks do (`WorkerAgent`);
* takes the controller's plans instead of SGLang's periodic refit
  (`EPLBManager.on_forward_pass_end` is wrapped; SGLang's own `init_by_eplb` no longer
  runs), and installs each committed placement with SGLang's own updater
  (`update_expert_location_with_recovery` -> `ExpertLocationUpdater`, which moves the
  weights with `batch_isend_irecv` between the old and the new physical-to-logical maps).

What holds, and what SGLang's updater cannot give
-------------------------------------------------
* Plan versions: a Prepare based on another version than the rank serves fails; windows
  carry the version they ran on and never straddle a switch.
* Ranks agree on the switch (invariant 2): every `REBALANCER_AGREE_EVERY` passes the
  ranks all-reduce(MIN) the newest version the controller told them to commit
  (`worker_hooks.agree.CommitAgreement`, on a gloo group of the adapter's own), so all
  ranks run the updater at the same forward pass. SGLang's passes are in lockstep across
  the EP group, so the updater's collective sends meet.
* Abort before commit (invariant 5): a bad placement, a wrong base version or a rank
  that disconnects before it prepared aborts the plan everywhere; nothing has moved.
* NOT given: weights moving before the commit. SGLang's updater writes the live weights
  (its staging is one layer of temporary buffers) and is a blocking collective of the
  forward loop, so it runs after the controller's commit, at the agreed pass; Prepare
  only checks and stages the map (PREPARED carries 0 bytes). A rank that dies *during*
  the update cannot be aborted: the controller has committed. What the adapter does
  about it: it runs the updater one layer at a time and, after each layer, all-reduces
  "layer done" on its own group (timeout `REBALANCER_AGREE_TIMEOUT_SECONDS`). The
  updater changes a layer's live weights only after all of that layer's transfers
  arrived and its map right after, so a layer is either fully moved or untouched; a
  rank whose layer moved but whose "layer done" failed restores that one layer from a
  copy taken before (one layer of the rank's experts, the size of SGLang's own
  temporary buffers). The survivors then all hold the same placement: the new one on
  the layers before the failed one, the old one from there on, every map matching its
  weights; each reports FAILED naming the layer, with the placement it now serves, and
  the adapter stops taking plans (the EP group has lost a rank and SGLang's own
  collectives fail as well; the orchestrator restarts the group, which then registers
  its placement). The controller ends the plan "partial" and records that mixed
  placement as what the deployment serves (store, `admin status`, metric
  `rebalancer_mixed_placement`); it starts no plan on top of it until the group's ranks
  have registered again as new processes. One edge is left: a rank that dies inside the
  one-integer "layer done" all-reduce itself, after some peers completed it, leaves
  those peers one layer ahead.
* SGLang comes first: settings that cannot work (TLS cert and key without a CA, a
  missing file) leave the plugin off with one log line at start; an error of the
  adapter while serving turns it off on that rank (an ERROR line with the traceback, its
  agent stops so the controller sees the rank leave) and SGLang goes on serving its
  placement (plugin.py). At the process's exit the last window and the pending reports
  go out (a SIGKILL loses them).
* Warm start in a replica pool (issue #24, `warm_start.py`): with `REBALANCER_POOL` the
  group is a pool member (its windows count in the pool's estimate, the pool rolls its
  placement to it as a plan), and a fresh group starts on the pool's placement: the
  plugin wraps `ModelRunner.maybe_init_expert_location_metadata` (before `load_model`),
  registers early for the offer (bounded by `REBALANCER_WARM_START_SECONDS`), and when
  every rank holds it, SGLang's initial expert location becomes the pool's map (SGLang's
  `init_by_mapping`); the adapter then serves it as version W. Otherwise SGLang starts
  on its own initial expert location, as before.
* Hot path: windows are copied off the device without waiting (pinned memory and an
  event on GPU) and handed to the agent thread; the agreement overlaps serving. The
  update itself stalls serving as SGLang's own rebalance does (it is that code).
"""

from __future__ import annotations

from worker_hooks.engines.sglang.config import SGLangAdapterConfig
from worker_hooks.engines.sglang.plugin import register

__all__ = ["SGLangAdapterConfig", "register"]
