"""The suite's vLLM workers forked from a server that has already imported torch and transformers.

Why: splicer's vLLM backend starts each worker with multiprocessing's "spawn", a fresh interpreter that imports torch
and then, at its first engine, the torch reference's transformers model (with the stand-in vLLM in tests/fake_vllm):
about 5 s per worker on the 2-core CI machine, and the suite starts about 60 of them. Here the test process's
"spawn" context, asked for by the backend alone, is multiprocessing's "forkserver" with those imports preloaded, so
each worker starts in well under a second. The backend's protocol, pickling of the worker's arguments included, is the
same under both (forkserver sends the target and its arguments pickled, as spawn does); what differs, and is carried
over here, is that a forked worker does not read the test's environment at its start: it gets the test process's
environment as it is when the worker starts, and PYTHONPATH's folders on its path, as a spawned interpreter would.

Only the test process is affected: a CLI run that a test starts as a subprocess, and splicer itself outside the suite,
spawn as before, and .ci/run runs the backend's protocol tests once more with SPLICER_TEST_SPAWN_WORKERS=1, which
leaves "spawn" alone.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

PRELOAD = ["torch", "transformers", "splicer.backends.vllm_child", "splicer.backends.torch_ref"]
BACKEND_MODULE = "splicer.backends.vllm_backend"
_get_context = multiprocessing.get_context


def _end_with(pid: int) -> None:
    """End this worker when process pid (the test process) is gone. A spawned worker's parent is the test process, and
    the worker asks the kernel to end it with its parent (vllm_child._die_with_parent); a forked one's parent is the
    forkserver, which outlives a killed test process."""
    import threading
    import time

    def watch():
        while True:
            time.sleep(1)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, daemon=True, name="end-with-the-test-process").start()


def _start_as_spawned(parent: int, environ: dict, target, args, kwargs):
    """In the forked worker: the environment and path a spawned interpreter would have had, then the backend's target."""
    _end_with(parent)
    os.environ.clear()
    os.environ.update(environ)
    for p in reversed([p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if p not in sys.path:
            sys.path.insert(0, p)
    target(*args, **kwargs)


class _ForkserverAsSpawn:
    """multiprocessing's forkserver context, whose Process starts its target as _start_as_spawned does."""

    def __init__(self):
        self._ctx = _get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def Process(self, group=None, target=None, name=None, args=(), kwargs=None, *, daemon=None):  # noqa: N802 (mp's name)
        return self._ctx.Process(
            group,
            _start_as_spawned,
            name,
            (os.getpid(), dict(os.environ), target, tuple(args), dict(kwargs or {})),
            daemon=daemon,
        )


_forkserver: _ForkserverAsSpawn | None = None


def get_context(method=None):
    """multiprocessing.get_context, except that the vLLM backend's "spawn" is the preloaded forkserver."""
    global _forkserver
    if method == "spawn" and sys._getframe(1).f_globals.get("__name__") == BACKEND_MODULE:
        if _forkserver is None:
            _forkserver = _ForkserverAsSpawn()
        return _forkserver
    return _get_context(method)


def install() -> None:
    if os.environ.get("SPLICER_TEST_SPAWN_WORKERS") != "1":  # set it to run the workers as splicer does outside tests
        multiprocessing.get_context = get_context
