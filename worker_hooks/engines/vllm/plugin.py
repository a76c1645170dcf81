"""vLLM's entry points into the adapter: the general plugin and the worker extension.

`register` is a `vllm.general_plugins` entry point: vLLM runs it in every process before
the model is built. Without REBALANCER_ADDRESS it does nothing and vLLM's own EPLB runs
unchanged. With it, it puts `controller_policy()` in `EPLB_POLICIES["default"]` (vLLM has
no policy registry: the setting is `Literal["default"]`, and async EPLB needs that name),
so `EplbState.add_model` picks it.

`RebalancerWorkerExtension` is named with `--worker-extension-cls`; vLLM mixes it into
its worker and calls `init_worker_extension` after the device is set up, before the model
is loaded, so the extension wraps the model runner's `eplb_step` on that one instance
and builds the adapter at the first real EPLB step, once `model_runner.eplb_state`
exists. vLLM is imported only inside what vLLM itself calls.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from rebalancer.errors import InputError
from worker_hooks.engines import require_engine
from worker_hooks.engines.vllm.config import VLLMAdapterConfig

log = logging.getLogger("worker_hooks.engines.vllm")

POLICY_MODULE = "vllm.distributed.eplb.policy"

_adapter: Any = None  # VLLMRebalanceAdapter of this process, built at the first EPLB step


def current_adapter() -> Any:
    """This process's adapter (None before the first EPLB step or when off)."""
    return _adapter


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


def controller_policy() -> type:
    """The policy class vLLM calls at its rearrangement point (one class per process)."""
    global _policy_class
    if _policy_class is not None:
        return _policy_class
    policies = require_engine(POLICY_MODULE, "vLLM", "vllm")

    class ControllerEplbPolicy(policies.AbstractEplbPolicy):  # type: ignore[name-defined,misc]
        """The controller's committed plan, agreed by every rank, or the map served.
        Before the adapter exists (vLLM's profile run) it is vLLM's own default policy,
        so the profile still reserves vLLM's transfer buffers."""

        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int,
                              num_nodes: int, num_ranks: int,
                              old_global_expert_indices: Any = None) -> Any:
            adapter = _adapter
            if adapter is None or old_global_expert_indices is None:
                return policies.DefaultEplbPolicy.rebalance_experts(
                    weight, num_replicas, num_groups, num_nodes, num_ranks,
                    old_global_expert_indices)
            return adapter.choose_map(old_global_expert_indices)

    _policy_class = ControllerEplbPolicy
    return _policy_class


def _build_adapter(config: VLLMAdapterConfig, eplb_state: Any) -> Any:
    from vllm.distributed.parallel_state import get_ep_group, get_eplb_group, get_node_count

    from worker_hooks.engines.vllm.adapter import VLLMRebalanceAdapter

    ep = get_ep_group()
    return VLLMRebalanceAdapter(config, eplb_state, get_eplb_group().cpu_group,
                                rank=int(ep.device_group.rank()), num_ranks=int(ep.device_group.size()),
                                num_nodes=int(get_node_count()))


class RebalancerWorkerExtension:
    """`--worker-extension-cls worker_hooks.engines.vllm.RebalancerWorkerExtension`."""

    def init_worker_extension(self) -> None:
        config = _config()
        runner = getattr(self, "model_runner", None)
        if config is None or runner is None or not hasattr(runner, "eplb_step"):
            return
        original = runner.eplb_step

        def eplb_step(is_dummy: bool = False, is_profile: bool = False) -> None:
            global _adapter
            state = getattr(runner, "eplb_state", None)
            if state is None or is_profile or not state.model_states:
                return original(is_dummy=is_dummy, is_profile=is_profile)
            if _adapter is None:
                try:
                    _adapter = _build_adapter(config, state)
                except Exception:
                    log.exception("rebalancer off: could not start the adapter")
                    runner.eplb_step = original
                    return original(is_dummy=is_dummy, is_profile=is_profile)
            adapter = _adapter
            try:
                before = np.array(adapter.serving_map(), copy=True)
            except Exception:
                before = adapter.phy2log
            original(is_dummy=is_dummy, is_profile=is_profile)
            try:
                adapter.after_step(before)
            except Exception:
                log.exception("rank %d: counts of step %d dropped", adapter.rank, adapter.step)

        runner.eplb_step = eplb_step

    def destroy_worker_extension(self) -> None:
        if _adapter is not None:
            _adapter.finish()


def save_load_dump(eplb_state: Any, path: str) -> None:
    """Save vLLM's load window and map (its first model) with torch, in the form
    `rebalancer plan --counts` reads (rebalancer/formats.py). vLLM has no dump of its own."""
    import torch

    model_state = next(iter(eplb_state.model_states.values()))
    torch.save({
        "expert_load_window": model_state.expert_load_window.detach().cpu(),
        "physical_to_logical_map": model_state.physical_to_logical_map.detach().cpu(),
        "num_logical_experts": int(model_state.model.num_logical_experts),
    }, path)
