"""The C heap as CPU training and decoding use it: freed tensor memory kept for the next step, not faulted in again.

PyTorch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold with a fresh
``mmap`` and gives the pages back on ``free``, so a tensor of a few MB allocated once per layer and per step
(activations, logits, a decoding step's scores) costs page faults on every first touch, each time. glibc's
threshold does adapt upwards, but the heap is trimmed back to the OS whenever its free top passes twice that
threshold, and a step then grows it again page by page. With the threshold at glibc's maximum (32 MB), the
trim threshold at 1 GB and 256 MB of top padding, CPU training and beam search run faster. The price: up to
1 GB of freed memory stays with the process instead of going back to the OS while it runs.

The same settings as environment variables (``MALLOC_MMAP_THRESHOLD_`` ...) would have to be set before the
interpreter starts; :func:`keep_freed_memory` applies them with ``mallopt`` from inside the process, once. Only
glibc has ``mallopt``: elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger("aiayn.allocator")

# mallopt parameters (glibc malloc.h) and the values set
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {"mmap_threshold": (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's maximum on 64-bit
            "trim_threshold": (_M_TRIM_THRESHOLD, 1 << 30),
            "top_pad": (_M_TOP_PAD, 256 << 20)}


@functools.cache
def keep_freed_memory() -> dict[str, int]:
    """Apply :data:`SETTINGS` to this process's glibc heap (once; later calls return the first result).

    Returns the settings that took effect, by name; empty where there is no glibc (nothing changed).
    """
    if not sys.platform.startswith("linux"):
        return {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {name: value for name, (param, value) in SETTINGS.items() if mallopt(param, value) == 1}
    log.debug("malloc settings applied: %s", applied)
    return applied
