"""The entry point SGLang calls (`sglang.srt.plugins`), and the two hooks it registers.

SGLang runs `register` in each of its processes (`load_plugins`). Without
REBALANCER_ADDRESS it registers nothing and SGLang's own EPLB runs unchanged. With it:
  * AFTER `_StatAccumulator.append`: every recorded pass's `[L, P]` count goes to the
    adapter's window (SGLang's recorder keeps its own buffer as before);
  * AROUND `EPLBManager.on_forward_pass_end`: the adapter's step replaces SGLang's
    periodic refit (the controller decides when and what; SGLang's updater moves).
SGLang is imported here only inside the functions SGLang itself calls.
"""

from __future__ import annotations

import logging
from typing import Any

from rebalancer.errors import InputError
from worker_hooks.engines import require_engine
from worker_hooks.engines.sglang.config import SGLangAdapterConfig

log = logging.getLogger("worker_hooks.engines.sglang")

ON_FORWARD_PASS_END = "sglang.srt.eplb.eplb_manager.EPLBManager.on_forward_pass_end"
STAT_ACCUMULATOR_APPEND = "sglang.srt.eplb.expert_distribution._StatAccumulator.append"

_config: SGLangAdapterConfig | None = None
_adapter: Any = None  # SGLangRebalanceAdapter, built at the first forward pass


def register() -> None:
    """SGLang's plugin entry point: hook the EPLB manager when the rebalancer is configured."""
    global _config
    try:
        config = SGLangAdapterConfig.from_env()
    except InputError as exc:
        log.error("rebalancer plugin off: %s", exc)
        return
    if config is None:
        log.info("rebalancer plugin off: REBALANCER_ADDRESS is not set")
        return
    hooks = require_engine("sglang.srt.plugins.hook_registry", "SGLang", "sglang")
    HookRegistry, HookType = hooks.HookRegistry, hooks.HookType

    _config = config
    HookRegistry.register(ON_FORWARD_PASS_END, _on_forward_pass_end, HookType.AROUND)
    HookRegistry.register(STAT_ACCUMULATOR_APPEND, _on_pass_counts, HookType.AFTER)


def current_adapter() -> Any:
    """This process's adapter (None before the first forward pass or when off)."""
    return _adapter


def _on_forward_pass_end(original: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
    global _adapter
    if _config is None:
        return original(manager, *args, **kwargs)
    if _adapter is None:
        from worker_hooks.engines.sglang.adapter import SGLangRebalanceAdapter

        _adapter = SGLangRebalanceAdapter(_config, manager)
    _adapter.on_forward_pass_end()
    return None


def _on_pass_counts(result: Any, accumulator: Any, forward_pass_id: Any, gatherer_key: Any,
                    single_pass_data: dict, *args: Any, **kwargs: Any) -> None:
    if _adapter is not None:
        _adapter.add_pass_counts(single_pass_data["global_physical_count"])
    return None
