"""Child processes that do not outlive their parent (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op).

A child started in its own session (torchrun) or a pool worker re-parented to PID 1 keeps running when its parent
is killed outright (kill -9, the OOM killer): it holds memory, GPUs and output folders with nothing left to own
it. The kernel can instead send the child a signal at the parent's death.

A server started as a child (the local stack's, a benchmark's model server) listens on a port free now
(:func:`free_port`).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1
_libc = None


def _prctl():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.prctl


def exit_with_parent(parent: int) -> None:
    """Run in the child: SIGTERM this process when ``parent`` (its parent's pid) dies. A pool's ``initializer``
    (with ``initargs=(os.getpid(),)``), or via :func:`preexec_exit_with_parent` a ``Popen`` ``preexec_fn``."""
    if not sys.platform.startswith("linux"):
        return
    _prctl()(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def preexec_exit_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (None off Linux). libc is loaded here, in the parent: between fork
    and exec the child only makes the call. The signal follows the thread that started the child, so start it from
    a thread that outlives it (the one that waits on it)."""
    if not sys.platform.startswith("linux"):
        return None
    _prctl()
    return functools.partial(exit_with_parent, os.getpid())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (tests and benchmarks start servers on these)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
