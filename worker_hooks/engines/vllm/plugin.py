"""vLLM's entry points into the adapter: the general plugin and the worker extension.

`register` is a `vllm.general_plugins` entry point: vLLM runs it in every process before
the model is built. Without REBALANCER_ADDRESS it does nothing and vLLM's own EPLB runs
unchanged. With it, it puts `controller_policy()` in `EPLB_POLICIES["default"]` (vLLM has
no policy registry: the setting is `Literal["default"]`, and async EPLB needs that name),
so `EplbState.add_model` picks it.

`RebalancerWorkerExtension` is named with `--worker-extension-cls`; vLLM mixes it into
its worker and calls `init_worker_extension` after the device is set up, before the model
is loaded. The extension attaches to what the model runner in use calls at its EPLB step,
on that one instance:

* Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`, vLLM 0.33.0's default): its
  `step_eplb_after` decorator calls `runner.eplb.step` (an `EPLBController`,
  `vllm/v1/worker/gpu/eplb_utils.py`), whose `state` is built at model load;
* Model Runner V1 (`VLLM_USE_V2_MODEL_RUNNER=0`): `runner.eplb_step`, over
  `runner.eplb_state`.

Either way, the first call that finds vLLM's `EplbState` wraps that state's own `step`
(the one method both runners end in), so the adapter sees exactly vLLM's EPLB steps (none
of V2's suppressed warm-up ones) and builds itself at the first real one. When neither
entry exists, the extension does not attach and says so: a WARNING with the reason, and
`attach_status()` (`attached` false, `reason`, `failures` counted), never silently; the
controller's policy then answers with vLLM's default and warns once. vLLM is imported
only inside what vLLM itself calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rebalancer.errors import InputError
from worker_hooks.engines import require_engine
from worker_hooks.engines.vllm.config import VLLMAdapterConfig

log = logging.getLogger("worker_hooks.engines.vllm")

POLICY_MODULE = "vllm.distributed.eplb.policy"

_adapter: Any = None  # VLLMRebalanceAdapter of this process, built at the first EPLB step
# (version, GPUs) of the world an elastic resize this rank survived left: the next adapter
# registers as the resized group (RegisterRequest.resized_from), then it is cleared.
_resized_from: tuple[int, int] | None = None


@dataclass
class AttachStatus:
    """Where the worker extension attached in this process (`attach_status()`)."""

    attached: bool = False
    runner: str = ""  # "v2" (runner.eplb.step) or "v1" (runner.eplb_step)
    reason: str = ""  # why it did not attach, or why the adapter is off
    failures: int = 0  # attach or start failures, each logged at WARNING or above
    waiting: bool = False  # the adapter waits for vLLM to fill its map's empty slots


_status = AttachStatus()
_profiling = threading.local()  # set while vLLM's profile rearrangement runs


def current_adapter() -> Any:
    """This process's adapter (None before the first EPLB step or when off)."""
    return _adapter


def attach_status() -> dict[str, Any]:
    """Whether the extension attached to vLLM's EPLB step, on which runner, and why not."""
    return asdict(_status)


def _config() -> VLLMAdapterConfig | None:
    try:
        return VLLMAdapterConfig.from_env()
    except InputError as exc:
        log.error("rebalancer off: %s", exc)
        return None


def register() -> None:
    """vLLM's general-plugin entry point: install the controller-driven policy."""
    if _config() is None:
        return
    policies = require_engine(POLICY_MODULE, "vLLM", "vllm")
    policies.EPLB_POLICIES["default"] = controller_policy()
    log.info("rebalancer: vLLM's EPLB policy is now the controller's")


_policy_class: Any = None
_warned_unattached = False


def controller_policy() -> type:
    """The policy class vLLM calls at its rearrangement point (one class per process)."""
    global _policy_class
    if _policy_class is not None:
        return _policy_class
    policies = require_engine(POLICY_MODULE, "vLLM", "vllm")

    class ControllerEplbPolicy(policies.AbstractEplbPolicy):  # type: ignore[name-defined,misc]
        """The controller's committed plan, agreed by every rank, or the map served; the
        adapter answers a drafter's call, or a call for another world, with vLLM's own
        default policy (VLLMRebalanceAdapter.answer). Before the adapter exists, and in
        vLLM's profile rearrangement, it is vLLM's own default policy, so the profile
        still reserves vLLM's transfer buffers."""

        @classmethod
        def rebalance_experts(
            cls,
            weight: Any,
            num_replicas: int,
            num_groups: int,
            num_nodes: int,
            num_ranks: int,
            old_global_expert_indices: Any = None,
        ) -> Any:
            default = policies.DefaultEplbPolicy.rebalance_experts
            adapter = _adapter
            if (
                adapter is None
                or old_global_expert_indices is None
                or getattr(_profiling, "on", False)
            ):
                if adapter is None and not _status.attached:
                    _warn_unattached()
                return default(
                    weight,
                    num_replicas,
                    num_groups,
                    num_nodes,
                    num_ranks,
                    old_global_expert_indices,
                )
            return adapter.answer(
                weight,
                num_replicas,
                num_groups,
                num_nodes,
                num_ranks,
                old_global_expert_indices,
                default,
            )

    _policy_class = ControllerEplbPolicy
    return _policy_class


def _warn_unattached() -> None:
    global _warned_unattached
    if _warned_unattached:
        return
    _warned_unattached = True
    log.warning(
        "rebalancer inert: vLLM called the controller's policy but the worker extension "
        "is not attached (%s); vLLM's default policy answered",
        _status.reason
        or "--worker-extension-cls worker_hooks.engines.vllm."
        "RebalancerWorkerExtension not set, or no EPLB step yet",
    )


def _build_adapter(config: VLLMAdapterConfig, eplb_state: Any) -> Any:
    """This rank's adapter on `eplb_state`, or None while vLLM's map has empty slots."""
    from worker_hooks.engines.vllm.adapter import VLLMRebalanceAdapter
    from worker_hooks.engines.vllm.layer_set import LayerSet

    empty = LayerSet(eplb_state).empty_slots()
    if empty:  # vLLM's default policy answers until its rearrangement fills them
        if not _status.waiting:
            log.info(
                "rebalancer waits: %d slots of vLLM's map hold no expert yet (elastic EP grew "
                "the group); the adapter starts once vLLM's rearrangement has filled them",
                empty,
            )
        _status.waiting = True
        return None
    _status.waiting = False
    from vllm.distributed.parallel_state import get_ep_group, get_eplb_group, get_node_count

    global _resized_from
    ep = get_ep_group()
    adapter = VLLMRebalanceAdapter(
        config,
        eplb_state,
        get_eplb_group().cpu_group,
        rank=int(ep.device_group.rank()),
        num_ranks=int(ep.device_group.size()),
        num_nodes=int(get_node_count()),
        resized_from=_resized_from,
    )
    _resized_from = None
    return adapter


def _fail(reason: str) -> None:
    _status.attached = False
    _status.reason = reason
    _status.failures += 1
    log.warning(
        "rebalancer inert on this rank: %s; vLLM's own EPLB runs unchanged and no "
        "window reaches the controller",
        reason,
    )


def attach(worker: Any, config: VLLMAdapterConfig) -> bool:
    """Attach to the EPLB step of `worker.model_runner` (V2: `eplb.step`; V1: `eplb_step`);
    False, with a WARNING and the reason in `attach_status()`, when neither is there."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        _fail(f"{type(worker).__name__} has no model_runner to attach to")
        return False
    controller = getattr(runner, "eplb", None)
    if (
        controller is not None
        and callable(getattr(controller, "step", None))
        and hasattr(controller, "state")
    ):
        owner, name, kind = controller, "step", "v2"
        state_of: Callable[[], Any] = lambda: controller.state  # noqa: E731
    elif callable(getattr(runner, "eplb_step", None)):
        owner, name, kind = runner, "eplb_step", "v1"
        state_of = lambda: getattr(runner, "eplb_state", None)  # noqa: E731
    else:
        _fail(
            f"{type(runner).__name__} has neither `eplb.step` (Model Runner V2) nor `eplb_step` "
            "(V1): this vLLM steps EPLB elsewhere"
        )
        return False
    original = getattr(owner, name)

    def eplb_step(is_dummy: bool = False, is_profile: bool = False) -> Any:
        state = state_of()
        if state is not None and getattr(state, "_rebalancer_config", None) is None:
            _instrument(state, config)
        return original(is_dummy=is_dummy, is_profile=is_profile)

    setattr(owner, name, eplb_step)
    _status.attached, _status.runner, _status.reason = True, kind, ""
    log.info(
        "rebalancer attached to vLLM's EPLB step (model runner %s, %s.%s)",
        kind,
        type(owner).__name__,
        name,
    )
    return True


def _instrument(state: Any, config: VLLMAdapterConfig) -> None:
    """Wrap this `EplbState`'s own `step` (vLLM calls it from either runner)."""
    original = state.step

    def step(is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        global _adapter
        if is_profile or not state.model_states:
            _profiling.on = is_profile
            try:
                return original(is_dummy, is_profile, log_stats=log_stats)
            finally:
                _profiling.on = False
        if _adapter is None and _status.attached:
            try:
                _adapter = _build_adapter(config, state)
            except Exception as exc:
                log.exception("rebalancer off: could not start the adapter")
                _fail(f"the adapter did not start: {type(exc).__name__}: {exc}")
        adapter = _adapter
        if adapter is None or adapter.eplb_state is not state:
            return original(is_dummy, is_profile, log_stats=log_stats)
        adapter.before_step()
        original(is_dummy, is_profile, log_stats=log_stats)
        try:
            adapter.after_step()
        except Exception:
            log.exception("rank %d: counts of step %d dropped", adapter.rank, adapter.step)
        return None

    original_rearrange = state.rearrange

    def rearrange(
        is_profile: bool = False, rank_mapping: dict[int, int] | None = None, **kwargs: Any
    ) -> Any:
        """vLLM's rearrangement; with `rank_mapping` (elastic EP resizes the group: old rank
        to new, -1 leaving) the adapter's policy answer may be the survivor placement the
        controller planned for exactly that loss (VLLMRebalanceAdapter.answer). The adapter
        holds the old world's group and shape: after a resize it stops, and the next step
        builds one on the new world, which registers as the resized group (the controller
        takes the new world: rebalancer/controller/resize.py)."""
        global _adapter, _resized_from
        adapter = _adapter
        if rank_mapping is None or adapter is None or adapter.eplb_state is not state:
            return original_rearrange(is_profile=is_profile, rank_mapping=rank_mapping, **kwargs)
        adapter.resizing = dict(rank_mapping)
        try:
            return original_rearrange(is_profile=is_profile, rank_mapping=rank_mapping, **kwargs)
        finally:
            adapter.resizing = None
            if not is_profile:
                _adapter = None
                if rank_mapping.get(adapter.rank, -1) >= 0:  # this rank is in the new world
                    _resized_from = (int(adapter.version), int(adapter.num_gpus))
                try:
                    adapter.finish(timeout=1.0)
                except Exception:
                    log.exception(
                        "rank %d: the adapter of the old world did not stop cleanly", adapter.rank
                    )

    state.step = step
    state.rearrange = rearrange
    state._rebalancer_config = config


class RebalancerWorkerExtension:
    """`--worker-extension-cls worker_hooks.engines.vllm.RebalancerWorkerExtension`."""

    def init_worker_extension(self) -> None:
        config = _config()
        if config is not None:
            attach(self, config)

    def destroy_worker_extension(self) -> None:
        if _adapter is not None:
            _adapter.finish()


def save_load_dump(eplb_state: Any, path: str) -> None:
    """Save vLLM's load window and map (its main model, not a drafter) with torch, in the
    form `rebalancer plan --counts` reads (rebalancer/formats.py). vLLM has no dump of its own."""
    import torch

    from worker_hooks.engines.vllm.layer_set import main_model_state

    model_state = main_model_state(eplb_state)
    torch.save(
        {
            "expert_load_window": model_state.expert_load_window.detach().cpu(),
            "physical_to_logical_map": model_state.physical_to_logical_map.detach().cpu(),
            "num_logical_experts": int(model_state.model.num_logical_experts),
        },
        path,
    )
