"""glibc's heap settings that workers use, as ``mallopt`` calls and as environment
variables (the same three values either way).

Workers keep freed memory in the heap, so that a step's activations are not handed back
to the kernel and faulted in again, zeroed, on the next step (measured: 462-1113 minor
faults per CNN step without, 0 with). Any process can have the same settings from its
environment (``MALLOC_*_`` variables, read by glibc when the process starts):
:func:`environment` gives them, and ``shmgrad bench`` runs every system with them so that
a comparison measures the engines, not the allocator. The TorchScript worker sets the
same values in C++ (worker/worker_loop.cc, keepFreedMemory).
"""

# mallopt parameters (malloc.h) and their values.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
TRIM_THRESHOLD_MAX = 2**31 - 1
TOP_PAD_BYTES = 16 << 20
MMAP_MAX = 0


def keep_freed_memory(libc) -> None:
    """Applies the settings to this process (``libc``: ``ctypes.CDLL("libc.so.6")``)."""
    libc.mallopt(M_MMAP_MAX, MMAP_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX)
    libc.mallopt(M_TOP_PAD, TOP_PAD_BYTES)


def environment() -> dict:
    """The same settings as environment variables, for a process about to start."""
    return {"MALLOC_MMAP_MAX_": str(MMAP_MAX),
            "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_MAX),
            "MALLOC_TOP_PAD_": str(TOP_PAD_BYTES)}
