"""SGLang plugin: SGLang's EPLB driven by the rebalancer's controller, no SGLang patch.

Installed as the project's wheel into SGLang's own environment (deploy/engines/sglang.Containerfile;
docs/operations.md, "Engine images"), SGLang finds `register` through
its plugin entry point (`sglang.srt.plugins`) in every process it starts. With
`--enable-eplb` and `REBALANCER_ADDRESS` set (the pod's sidecar socket or the
controller; `worker_hooks/engines/sglang/config.py` lists the other variables), each rank

* streams the counts SGLang's own recorder gathers (`_StatAccumulator.append`, one
  `[L, P]` physical count per forward pass) to the controller every
  `REBALANCER_WINDOW_STEPS` passes, as the project's own hooks do (`WorkerAgent`);
* takes the controller's plans instead of SGLang's periodic refit
  (`EPLBManager.on_forward_pass_end` is wrapped; SGLang's own `init_by_eplb` no longer
  runs), and installs each one with the **staged update** or SGLang's own updater
  (`update_expert_location_with_recovery` -> `ExpertLocationUpdater`, which moves the
  weights with `batch_isend_irecv` inside the forward loop, between passes, serving
  stopped for the whole move). `REBALANCER_UPDATER=auto` (default) picks by the backend
  the weights move over (config.choose_updater): **on NCCL (weights on GPU) SGLang's
  updater, between passes at the agreed pass**; on gloo (CPU) the staged update.
  `staged` or `sglang` force one (staged on NCCL with a WARNING at start: below).

Staging on NCCL (issue 29): the staged update receives the weights with NCCL p2p on a
background thread, on a communicator of its own, while SGLang's forward pass runs its own
NCCL collectives on the serving thread. The two communicators' kernels are then issued in
an order that differs from rank to rank, which NCCL does not promise to run without
deadlock (vLLM refuses the same pattern for its own async EPLB, "NCCL multi-stream
conflicts"). The transports that use no NCCL (ipc, outbox: CUDA IPC within one host) map
one stacked tensor per weight, and SGLang's expert weights are one tensor per layer, so
they cannot move them. Hence the default on NCCL: the weights move between passes, at the
pass every rank agreed on, on SGLang's thread and with SGLang's own code, nothing beside
SGLang's collectives; serving waits for the move as it does with SGLang's own EPLB.

The staged update (adapter.py on worker_hooks/session/staging.py)
-----------------------------------------------------------------
* Prepare: each rank takes its incoming experts from the plan's transfer list and
  receives them into staging buffers on a background thread, with the project's p2p
  transport (worker_hooks/transports/p2p.py on SGLang's own per-layer expert tensors) over a
  process group of the adapter's own (NCCL on GPU, gloo on CPU; never the group of
  SGLang's forward collectives). Sources are the old placement's live rows, which nothing
  writes before the commit. First every rank takes the plan through the transfer fence
  (worker_hooks/fence.py). PREPARED only once every incoming expert is staged.
* Commit: at the pass all ranks agreed on (`worker_hooks.agree.CommitAgreement`, an
  all-reduce(MIN) every `REBALANCER_AGREE_EVERY` passes on a gloo group of the adapter's
  own, overlapping serving), the staged rows are copied into the live rows (local copies
  only, storage unchanged) and SGLang's maps of those layers are updated in place with
  SGLang's own `ExpertLocationMetadata.update(other, update_layer_ids)`, so the tensors
  CUDA graphs captured stay the same. Nothing crosses ranks inside the forward loop.
* Staging budget (`REBALANCER_STAGING_BUDGET_BYTES`, default 4 GiB per rank, config.py
  says why): a plan whose incoming experts exceed it on some rank commits in groups of
  consecutive layers, each staged and swapped at an agreed pass of its own; between
  swaps each layer is on the old or the new placement, its map always matching its
  weights (windows then carry logical counts only).
* All or nothing (invariant 5): an Abort before the commit drops the staging on every
  rank, nothing live changed; a rank that refuses, fails or is killed while staging
  fails the transfers of its peers (the fence, or the broken transfer), they report
  FAILED and the controller aborts the plan everywhere. The first layer group is staged
  before PREPARED, so a plan within the budget is all or nothing in full.
* Ranks switch together (invariant 2): every swap happens at the same pass on every
  rank (agreed tickets, worker_hooks/session/staging.py); windows never straddle a swap.
* Dispatch follows each swap: SGLang's map tensors are updated in place, and with
  `--ep-dispatch-algorithm lp` SGLang's per-layer LP solvers are rebuilt from the new
  metadata after each swap (`init_lplb_solvers`, what SGLang's own update does), inside
  the swap's pause.

What holds either way
---------------------
* Plan versions: a Prepare based on another version than the rank serves fails; windows
  carry the version they ran on and never straddle a switch.
* SGLang comes first: settings that cannot work (TLS cert and key without a CA, a
  missing file, an unknown updater) leave the plugin off with one log line at start;
  SGLang's recorder in `per_pass` or `per_token` mode (records for a dump file, no
  counts: no window could be sent) turns the adapter off at the first pass on every rank
  with one ERROR line naming the setting and `stat` to use instead; an
  error of the adapter while serving turns it off on that rank (an ERROR line with the
  traceback, its agent stops so the controller sees the rank leave) and SGLang goes on
  serving its placement (plugin.py). At the process's exit the last window and the
  pending reports go out (a SIGKILL loses them).
* Warm start in a replica pool (issue #24, `warm_start.py`): with `REBALANCER_POOL` the
  group is a pool member (its windows count in the pool's estimate, the pool rolls its
  placement to it as a plan), and a fresh group starts on the pool's placement: the
  plugin wraps `ModelRunner.maybe_init_expert_location_metadata` (before `load_model`),
  registers early for the offer (bounded by `REBALANCER_WARM_START_SECONDS`), and when
  every rank holds it, SGLang's initial expert location becomes the pool's map (SGLang's
  `init_by_mapping`); the adapter then serves it as version W. Otherwise SGLang starts
  on its own initial expert location, as before.
* Hot path: windows are copied off the device without waiting (pinned memory and an
  event on GPU) and handed to the agent thread; the agreement overlaps serving.

What SGLang still cannot give
-----------------------------
* After the commit of a plan larger than the budget, the later layer groups move after
  the controller committed: a rank lost while one of them is staged cannot be aborted.
  The survivors keep the groups already swapped (every map matching its weights), report
  FAILED with the mixed placement they serve, and stop taking plans; the controller ends
  the plan "partial" and records that placement (`rebalancer_mixed_placement`) until the
  group restarts. With SGLang's updater the same holds per layer (it runs one layer at
  a time, each confirmed on the adapter's group, a layer that moved on one rank only is
  restored from a copy); one edge is left there: a rank that dies inside the one-integer
  "layer done" all-reduce itself leaves the peers that completed it one layer ahead.
* Staging lives beside SGLang's KV cache: SGLang sizes its memory pool at start and
  knows nothing of the budget, so leave it room (`--mem-fraction-static`); the buffers
  are allocated per group by torch's caching allocator, not reserved.
* The swap still copies the staged rows in place (SGLang's dispatch indexes slots, not
  spare rows as the project's own hooks can): the pause is one local copy of the
  group's experts, never a transfer between ranks (1.9 ms for a 3.96 GB group, 5 layers
  x 9 DeepSeek-V3 experts, on one H200; SGLang's updater spends 9.1 ms on the same group's
  in-step copies alone, its NCCL transfers on top: BENCHMARKS.md). The staging budget
  bounds that pause.
* Staged on GPU (`REBALANCER_UPDATER=staged` on NCCL, at the risk said above): the p2p
  transport's NCCL kernels take SMs from serving while they run (the
  peer-memory transports of the project's hooks map one stacked tensor per weight;
  SGLang's are per layer, so only p2p moves them). A rank killed mid-staging is shown
  on gloo (tests/engines/sglang); on NCCL a dead peer's transfer may hang instead of
  raising, until the group's timeout (`REBALANCER_AGREE_TIMEOUT_SECONDS`): the staging
  thread waits, serving does not (the controller aborts the plan on the rank's
  disconnect meanwhile), but its NCCL kernel holds SMs until then. Not yet shown on GPUs.
"""

from __future__ import annotations

from worker_hooks.engines.sglang.config import SGLangAdapterConfig
from worker_hooks.engines.sglang.plugin import register

__all__ = ["SGLangAdapterConfig", "register"]
