"""The entry point SGLang calls (`sglang.srt.plugins`), and the two hooks it registers.

SGLang runs `register` in each of its processes (`load_plugins`). Without
REBALANCER_ADDRESS it registers nothing and SGLang's own EPLB runs unchanged. With it:
  * AFTER `_StatAccumulator.append`: every recorded pass's `[L, P]` count goes to the
    adapter's window (SGLang's recorder keeps its own buffer as before);
  * AROUND `EPLBManager.on_forward_pass_end`: the adapter's step replaces SGLang's
    periodic refit (the controller decides when and what; the adapter stages the weights
    beside serving and swaps them at an agreed pass, or SGLang's updater moves them);
  * AROUND elastic EP's `maybe_rebalance_after_rank_fault` and, inside it only, AROUND
    `eplb_algorithms.rebalance_experts`: a rank fault places the survivors on the
    controller's planned survivor placement when every rank holds it, else SGLang's own
    algorithm does, and the adapter reports what the survivors serve (fault.py).
SGLang is imported here only inside the functions SGLang itself calls.

SGLang's recorder in `per_pass` or `per_token` mode hands over no counts (config.recorder_refusal):
the adapter is then off from the first pass on every rank, with one ERROR line naming
the setting and `stat` to use instead, and SGLang serves as below.

The inference pod comes first: an error of the adapter (building it, a pass's counts, its
step) never reaches SGLang's forward loop. It turns the adapter off on that rank for good,
loudly: one ERROR line with the traceback, and its agent stops, so the controller sees the
rank leave (`rebalancer_connected_ranks`, alert `RebalancerRanksDisconnected`; the
adapter has no metrics endpoint of its own in SGLang's process). SGLang goes on serving
the placement it holds, without rebalancing (never SGLang's own EPLB instead: its refit is
a collective the other ranks, still on the adapter, would not join). The disabled rank
still answers the ranks' commit agreement with its version, so its peers never switch
without it and never wait for it.

At the process's exit (SGLang's scheduler returns after a ShutdownReq; any normal exit)
the adapter sends its last window and the reports it holds (`finish`, bounded by
FINISH_SECONDS); a SIGKILL loses them.
"""

from __future__ import annotations

import logging
import multiprocessing.util
from typing import Any

from rebalancer.errors import InputError
from worker_hooks.engines import require_engine
from worker_hooks.engines.sglang.config import SGLangAdapterConfig, recorder_refusal

log = logging.getLogger("worker_hooks.engines.sglang")

ON_FORWARD_PASS_END = "sglang.srt.eplb.eplb_manager.EPLBManager.on_forward_pass_end"
STAT_ACCUMULATOR_APPEND = "sglang.srt.eplb.expert_distribution._StatAccumulator.append"

# Seconds the adapter may take at exit to send its last window and reports.
FINISH_SECONDS = 3.0

_config: SGLangAdapterConfig | None = None
_adapter: Any = None  # SGLangRebalanceAdapter, built at the first forward pass
_disabled: str | None = None  # why the adapter was turned off on this rank, for good
_early_counts: Any = None  # [L, P] counts of the passes before the adapter exists


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
    # Elastic EP's fault path on the controller's planned survivor placement (fault.py).
    from worker_hooks.engines.sglang import fault

    HookRegistry.register(fault.FAULT_PATH, _on_rank_fault, HookType.AROUND)
    HookRegistry.register(fault.REBALANCE_EXPERTS, _on_rebalance_experts, HookType.AROUND)
    if config.link.pool:  # a pool member starts on the pool's placement (every rank: a collective)
        from worker_hooks.engines.sglang import warm_start

        HookRegistry.register(
            warm_start.INIT_EXPERT_LOCATION, _on_init_expert_location, HookType.AROUND
        )


def _refusal() -> str | None:
    """Why SGLang's settings leave the adapter nothing to work with (read once SGLang
    published them: after `register`), or None."""
    from sglang.srt.runtime_context import get_exec

    return recorder_refusal(get_exec().moe.expert_distribution_recorder_mode)


def _on_init_expert_location(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    from worker_hooks.engines.sglang import warm_start

    assert _config is not None
    if _refusal() is not None:  # the adapter will not run: no warm start either
        return original(runner, *args, **kwargs)
    return warm_start.around_init_expert_location(_config, original, runner, *args, **kwargs)


def _serving_adapter() -> Any:
    """The adapter while it runs (None before the first pass or once turned off)."""
    return _adapter if _disabled is None else None


def _on_rank_fault(original: Any, *args: Any, **kwargs: Any) -> Any:
    from worker_hooks.engines.sglang import fault

    return fault.around_fault_path(_serving_adapter, original, *args, **kwargs)


def _on_rebalance_experts(original: Any, *args: Any, **kwargs: Any) -> Any:
    from worker_hooks.engines.sglang import fault

    return fault.around_rebalance_experts(_serving_adapter, original, *args, **kwargs)


def current_adapter() -> Any:
    """This process's adapter (None before the first forward pass or when off)."""
    return _adapter


def disabled_reason() -> str | None:
    """Why the adapter was turned off on this rank (None while it runs)."""
    return _disabled


def _disable(what: str, exc: BaseException) -> None:
    """An adapter error: turn the adapter off on this rank, loudly; SGLang keeps serving."""
    global _disabled
    _disabled = f"{what}: {type(exc).__name__}: {exc}"
    log.error(
        "rebalancer adapter DISABLED on this rank (%s); SGLang keeps serving its current "
        "placement without rebalancing",
        _disabled,
        exc_info=exc,
    )
    if _adapter is not None:
        try:
            _adapter.disable(_disabled)
        except Exception:  # already off: nothing more may reach SGLang
            log.exception("rebalancer adapter: stopping it failed")


def _refuse(reason: str) -> None:
    """SGLang's settings leave the adapter nothing to work with: off on this rank from the
    first pass (every rank has the same settings), one ERROR line with the reason and the
    setting to use. SGLang keeps serving its placement (never its own refit instead)."""
    global _disabled
    _disabled = reason
    log.error(
        "rebalancer adapter DISABLED on this rank: %s. SGLang keeps serving its current "
        "placement without rebalancing",
        reason,
    )


def _on_forward_pass_end(original: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
    global _adapter, _early_counts
    if _config is None:
        return original(manager, *args, **kwargs)
    if _disabled is not None:
        _idle_step()
        return None
    try:
        if _adapter is None:
            refusal = _refusal()
            if refusal is not None:
                _refuse(refusal)
                return None
            from worker_hooks.engines.sglang.adapter import SGLangRebalanceAdapter

            _adapter = SGLangRebalanceAdapter(_config, manager)
            from worker_hooks.engines.sglang import warm_start

            warm_start.hand_over(_adapter)  # serves the pool placement SGLang started on
            multiprocessing.util.Finalize(None, _finish_at_exit, exitpriority=100)
            if _early_counts is not None:  # the first pass recorded before the adapter existed
                _adapter.add_pass_counts(_early_counts)
                _early_counts = None
        _adapter.on_forward_pass_end()
    except Exception as exc:
        _disable("forward pass end", exc)
    return None


def _idle_step() -> None:
    """A disabled adapter still answers the ranks' commit agreement with the version it
    serves: no peer then agrees on a switch this rank would not make, and none waits on it."""
    global _adapter
    if _adapter is None:
        return
    try:
        _adapter.idle_step()
    except Exception:
        log.exception("rebalancer adapter: its commit agreement failed too; it is left alone")
        _adapter = None


def _on_pass_counts(
    result: Any,
    accumulator: Any,
    forward_pass_id: Any,
    gatherer_key: Any,
    single_pass_data: dict,
    *args: Any,
    **kwargs: Any,
) -> None:
    global _early_counts
    if _config is None or _disabled is not None:
        return None
    try:
        counts = single_pass_data["global_physical_count"]
        if _adapter is not None:
            _adapter.add_pass_counts(counts)
        elif _early_counts is None:
            _early_counts = counts.clone()
        else:
            _early_counts += counts
    except Exception as exc:
        _disable("pass counts", exc)
    return None


def _finish_at_exit() -> None:
    """The process ends: the last window and pending reports go out (bounded)."""
    if _adapter is None:
        return
    try:
        if _disabled is not None:  # no collective left pending when the process group goes
            _adapter.agreement.close()
            return
        _adapter.finish(FINISH_SECONDS)
    except Exception:
        log.exception("rebalancer adapter: the last window could not be sent at exit")
