"""How the kit starts ipyparallel's engines and controller, with a heart monitor that registers a new
engine at its first answer."""
from __future__ import annotations

from colab_par.compat.support import _missing

ENGINE_MAIN_CODE = "from ipyparallel.engine.app import main; main()"
"""Python that starts an engine (`ipyparallel.engine.app.main`, what `ipengine` runs)."""

ENGINE_MAIN_FILE = "ipyparallel/engine/app.py"
"""The source file of that entry point: the bottom frame of an engine's main thread in a stack dump."""

CONTROLLER_MAIN_CODE = "from colab_par.compat import run_controller; run_controller()"
"""Python that starts the kit's controller: `ipcontroller` with `prompt_heart_monitor`."""


def prompt_heart_monitor() -> type:
    """ipyparallel's heart monitor, registering a new engine when its heart first answers a ping.

    Its own (`ipyparallel.controller.heartmonitor.HeartMonitor.beat`, undocumented) notices a new
    heart only at the beat after the ping it answered, so every engine waits one more heartbeat
    period to be registered (0.1 s of each start at the kit's period). Known hearts are judged as
    before, at each beat."""
    from ipyparallel.controller import heartmonitor

    base = heartmonitor.HeartMonitor
    if not all(hasattr(base, name) for name in ("handle_pong", "handle_new_hearts", "hearts", "responses")):
        raise _missing("ipyparallel", "HeartMonitor.handle_pong / handle_new_hearts")

    class PromptHeartMonitor(base):
        def handle_pong(self, msg: list) -> None:
            super().handle_pong(msg)
            heart = msg[0]
            if heart in self.responses and heart not in self.hearts:
                self.handle_new_hearts({heart})

    return PromptHeartMonitor


def run_controller() -> None:
    """Run `ipcontroller` (`ipyparallel.controller.app.main`) with `prompt_heart_monitor`. Its
    heart monitor runs in a `multiprocessing.Process` forked from this one (Linux's start method up
    to Python 3.13), which keeps the class; a process that imported afresh would beat as before."""
    from ipyparallel.controller import heartmonitor
    from ipyparallel.controller.app import main

    heartmonitor.HeartMonitor = prompt_heart_monitor()
    main()
