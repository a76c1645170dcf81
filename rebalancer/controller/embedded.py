"""A controller server running on a thread of the calling process.

Used by the demo (workers are separate processes, the controller and its
observers live with the orchestrator) and by tests that need a real server on
loopback next to assertions on its state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.loop_busy import timed_loop
from rebalancer.controller.server import ControllerServer


class EmbeddedController:
    """The controller's event loop on a thread of this process."""

    def __init__(
        self, config: ControllerConfig, setup: Callable[[ControllerServer], None] | None = None
    ) -> None:
        self.config = config
        self.setup = setup
        self.server: ControllerServer | None = None
        self.loop = timed_loop()  # its busy share exported, as `rebalancer serve`'s
        self.ready = threading.Event()
        self.error: BaseException | None = None  # why it did not start
        self.thread = threading.Thread(target=self._run, name="controller", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of start()
            if not self.ready.is_set():
                self.error = exc
                self.ready.set()
            else:
                raise
        finally:
            self.loop.close()

    async def _main(self) -> None:
        server = ControllerServer(self.config)
        if self.setup is not None:
            self.setup(server)
        await server.start()
        self.server = server
        self.ready.set()
        await server.wait()

    def start(self) -> ControllerServer:
        """The server, serving; the error it raised if it could not start (InputError:
        a store in use, a busy port, a bad TLS file, ...)."""
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("controller did not start")
        if self.error is not None:
            self.thread.join(30)
            raise self.error
        assert self.server is not None
        return self.server

    def stop(self) -> None:
        """Stop the server and its thread; again: nothing (a test may stop it mid-run and
        again in its `finally`)."""
        if self.server is not None and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.thread.join(30)

    def call(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the controller's loop thread (state is not thread-safe) and return its
        result."""

        async def run() -> object:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)
