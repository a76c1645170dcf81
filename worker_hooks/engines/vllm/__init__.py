"""vLLM adapter: vLLM's own EPLB driven by the rebalancer's controller, no vLLM patch.

Installed as the project's wheel into vLLM's own environment (deploy/engines/vllm.Containerfile;
docs/operations.md, "Engine images"), vLLM finds `register` through its
`vllm.general_plugins` entry point in every process; with `REBALANCER_ADDRESS` set
(the pod's sidecar socket or the controller; worker_hooks/engines/vllm/config.py lists
the other variables) and vLLM started with
`--enable-eplb --worker-extension-cls worker_hooks.engines.vllm.RebalancerWorkerExtension`
(and, if `VLLM_PLUGINS` is set, `rebalancer` in it), each rank attaches to the EPLB step
of its model runner (V2, vLLM 0.33.0's default: `runner.eplb.step` from
`step_eplb_after`; V1: `runner.eplb_step`; either way vLLM's `EplbState.step` is wrapped,
plugin.py), or logs a WARNING with the reason and reports it in `attach_status()`, and

* streams the counts vLLM's own EPLB records (`EplbModelState.expert_load_window`, read
  at vLLM's own cursor after each `EplbState.step`), mapped to logical experts through
  the map each pass ran on, to the controller every `REBALANCER_WINDOW_STEPS` steps
  (`WorkerAgent`, as the project's own hooks do). vLLM records only the last
  `window_size` steps before each rearrangement: set `window_size >= step_interval`
  (the adapter logs a warning otherwise). vLLM's window holds routed experts of MoE
  layers only: shared experts and dense layers are not slots in vLLM's EPLB and are
  not counted;
* answers vLLM's policy call (`EPLB_POLICIES["default"]` is the controller's policy)
  with the controller's committed plan, which vLLM's own code then moves
  (`rearrange_expert_weights_inplace` in sync mode, the async worker's per-layer
  `transfer_layer` / `move_from_buffer` in async mode).

What holds, and what vLLM cannot give
-------------------------------------
* Ranks agree before vLLM moves anything: at vLLM's rearrangement point every rank
  all-reduces (MIN) the newest version the controller committed and it has staged, then
  the plan's hash (MIN of h and -h), on vLLM's EPLB CPU group. All ranks return that
  plan, or all return the map they serve (nothing moves) when the hashes differ, a rank
  lacks the plan, or the plan does not fit (`[L, P]`, every expert held, built on the
  map vLLM serves). vLLM itself never checks that ranks return the same map (a rank
  with another map hangs its peers in the communicator); this agreement is what
  prevents it. The policy never raises into vLLM (an exception there stops vLLM's async
  EPLB thread for good, or the engine in sync mode): any failure keeps the old map.
* Versions: a Prepare based on another version than the rank serves fails; windows
  carry the version and the map they ran on and never span two maps.
* NOT given: a two-phase commit. vLLM moves the live weights inside `rearrange` and has
  no staging the controller could abort, so the controller's Commit comes before
  vLLM's policy call: PREPARED means checked (and the plan staged on the host), the
  agreement above happens after the Commit. A version counts as applied, and is
  reported COMMITTED, only when vLLM is done (`rebalanced` false again) and its
  `physical_to_logical_map` equals the plan; otherwise FAILED is reported.
* NOT given: a rank dying mid-rearrangement. vLLM's transfer is a collective of its
  EP group; the survivors' vLLM hangs or fails there, as with vLLM's own policy.
* NOT given: one placement per step in async mode. vLLM's async EPLB switches one layer
  per step, so while it runs, layers before the cursor serve the new map and the rest
  the old one (each layer's map matches its weights); windows of those steps carry the
  old version and the per-layer map they ran on.
* Counts duplicated by vLLM: under the naive all-to-all every DP rank counts every
  token, and TP ranks inside an EP rank count the same tokens; set
  `REBALANCER_COUNT_DUPLICATES` to that factor (windows are divided by it, rounded).
* Plans only arrive at vLLM's own rearrangement points (`step_interval`); between them
  the controller's plan waits.
* The serving thread does not wait for the device on the adapter's account: a window's
  counts go to the host with non-blocking copies (pinned memory and an event on CUDA;
  worker_hooks/session/windows.py), and the map each pass runs on is mirrored on the
  host from vLLM's own results (async: `EplbModelState.pending_result`). vLLM's map is
  read once per plan, where vLLM's own rearrangement synchronises.
* Maps with empty slots (`-1`, elastic EP's scale-up padding): no adapter is built while
  a balanced model's map has them; vLLM's default policy fills them and the adapter
  starts at the next EPLB step (`attach_status()["waiting"]`).
* Models: the deployment is a layer set (worker_hooks/engines/vllm/layer_set.py), the
  main model's MoE layers first, then every drafter vLLM registers with EPLB (MTP)
  whose experts have the main model's shape: the controller balances the drafter's
  layers with the main model's, one plan covers both, and each of vLLM's per-model policy calls
  takes its own rows of the one agreed plan, so a drafter's call never fails or delays the main
  model's plan. A drafter of another expert shape is rearranged by vLLM's own default
  policy (the same on every rank, outside the agreement) and its counts are not sent.
* Another world: when vLLM asks the policy for another `num_replicas`/`num_ranks` than
  the controller plans for (elastic EP scaling, `rearrange(rank_mapping=...)`), the answer
  has the shape asked: for a scale-down the controller planned ahead (the survivor
  placement it sent for exactly the ranks leaving, on the map served, held by every
  rank: one all-reduce of its digest), that placement; otherwise vLLM's default policy
  (WARNING). The adapter then stops; the next EPLB step builds one on the new world,
  which registers as the resized group (the world before: `RegisterRequest.resized_from`)
  and the controller takes the new world as the deployment's shape and committed
  placement (rebalancer/controller/resize.py); the rank serves the version it is given.
* Warm start (`REBALANCER_POOL`): a fresh group offered the pool's placement at Register
  installs it at vLLM's first policy call, when every rank holds the same offer
  (all-reduce of the offered version on the EPLB CPU group, worker_hooks/warm.py, then
  the plan agreement above), and reports it committed; otherwise every rank keeps its
  map. The wait for the offer is bounded (`REBALANCER_WARM_START_SECONDS` from the
  adapter's start) and happens once. NOT given: the steps before that first policy call
  serve vLLM's start map (vLLM takes a map only at its rearrangement points).
"""

from __future__ import annotations

from worker_hooks.engines.vllm.config import VLLMAdapterConfig
from worker_hooks.engines.vllm.plugin import RebalancerWorkerExtension, register, save_load_dump

__all__ = ["RebalancerWorkerExtension", "VLLMAdapterConfig", "register", "save_load_dump"]
