"""`omnijax.heap.trim_heap` gives freed heap pages back to the system (glibc): memory freed below a live allocation
stays resident until it is trimmed. The oracle is the kernel's count of the process's anonymous resident pages."""

from __future__ import annotations

import ctypes

from omnijax.heap import trim_heap

BLOCK, BLOCKS = 4096, 20_000  # 80 MB in blocks below glibc's mmap threshold: they come from the heap


def resident_anonymous() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def test_trim_returns_the_pages_freed_below_a_live_block():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    trim_heap()
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # resident
    pinned = libc.malloc(64)  # above them: the heap's top cannot shrink past it when they are freed
    try:
        for block in blocks:
            libc.free(block)
        freed = resident_anonymous()
        assert trim_heap() is True
        trimmed = resident_anonymous()
    finally:
        libc.free(pinned)
    # the freed blocks stayed resident until the trim, which returned most of their 80 MB
    assert freed - trimmed >= 0.75 * BLOCK * BLOCKS, (freed, trimmed)
