"""glibc's malloc kept from handing a CPU train step's buffers back to the kernel every step.

XLA:CPU takes an execution's buffers from malloc. glibc maps a block above its mmap threshold (128 KiB,
rising to at most 32 MiB as such blocks are freed) straight from the kernel and unmaps it when freed, and
gives the top of a heap back once more than 128 KiB of it is free; a step whose buffers are larger (a
translation model's logits and their gradient) then faults in fresh zeroed pages on every step: the
demo spent a quarter of its CPU time in the kernel. With both thresholds raised, a freed buffer stays in
the process for the next step (the demo before and after: benchmarks/RESULTS.md, "CPU train steps")."""
from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameter numbers (<malloc.h>)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap, and up to 1 GiB free at its top stays there
TOP_PAD_BYTES = 256 << 20  # each time a heap grows, it grows by this much more, as address space


def keep_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False (nothing changed) off glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS's libc has no mallopt)
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, KEEP_BYTES), (_M_TRIM_THRESHOLD, KEEP_BYTES), (_M_TOP_PAD, TOP_PAD_BYTES)))
