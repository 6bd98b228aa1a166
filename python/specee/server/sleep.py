"""--sleep-idle-seconds N: after N seconds without a request that needs the model, the model and its slots are
unloaded (their memory freed); the next such request loads them again (the same file and options) before it runs.

Read-only endpoints (`READ_ONLY`: /health, /props, /models, /metrics) answer from what the server keeps without the
model, and do not wake it. The Guard (app.py) holds the sleeper around every other request: `hold` wakes the model
and counts the request, `release` counts it out; the watcher thread unloads the model once no request is held, the
engine has nothing queued or running, and the last request ended N seconds ago. The metrics live in the engine, so
they carry across a sleep.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from specee._core import SpecEEError
from specee.model import Model
from specee.server.engine import ServerState
from specee.server.request import ApiError

READ_ONLY = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models", "/metrics"})


class Sleeper:
    """Unloads `state`'s model after `idle_seconds` without a held request; `load` makes the model again."""

    def __init__(self, state: ServerState, idle_seconds: float, load: Callable[[], Model]) -> None:
        self.state, self.idle_seconds, self.load = state, idle_seconds, load
        self.lock = threading.Lock()  # held while the model is loaded or unloaded
        self.held = 0  # requests that need the model, in progress
        self.last = time.monotonic()  # when the last of them ended
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="specee-sleep", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def hold(self) -> None:
        """A request that needs the model begins: the model is loaded first if it sleeps (blocking: call it off the
        event loop). A failed load is a 503 (ApiError), and the request is not counted."""
        with self.lock:
            if self.state.sleeping:
                started = time.monotonic()
                try:
                    model = self.load()
                except (OSError, ValueError, SpecEEError) as e:  # the file gone or changed since the start
                    raise ApiError(503, f"the model could not be loaded again: {e}", "server_error") from None
                self.state.engine.load(model)
                self.state.model = model
                self.state.sleeping = False
                print(f"specee-server: the model is loaded again ({time.monotonic() - started:.2f} s)", file=sys.stderr,
                      flush=True)
            self.held += 1

    def release(self) -> None:
        with self.lock:
            self.held -= 1
            self.last = time.monotonic()

    def _watch(self) -> None:
        while not self.stopping.wait(min(0.1, self.idle_seconds / 4)):
            with self.lock:
                if self.state.sleeping or self.held or time.monotonic() - self.last < self.idle_seconds:
                    continue
                engine = self.state.engine
                with engine.cond:
                    if engine.waiting or engine.running:
                        continue
                    engine.unload()
                self.state.sleeping = True
                print(f"specee-server: idle for {self.idle_seconds:g} s: the model is unloaded until the next request",
                      file=sys.stderr, flush=True)
