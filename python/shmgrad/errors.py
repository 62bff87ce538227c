"""Exceptions raised by shmgrad. Every one is a subclass of :class:`Error`."""


class Error(Exception):
    """Base class of every shmgrad error."""


class InvalidArgumentError(Error, ValueError):
    """Bad input: an unknown loss, a mismatched module, an index out of range, an empty batch."""


class EngineNotFoundError(Error, LookupError):
    """No engine of that name is running, or a file it needs does not exist."""


class BusyError(Error):
    """Another trainer holds the engine (the message names its pid), or what shmgrad
    would open belongs to another user or could have been changed by one (an engine of
    theirs, a name planted in /dev/shm, an eager job file that is not private): the
    message names it."""


class EngineTimeoutError(Error, TimeoutError):
    """A wait ran past its timeout. The engine keeps serving. A subclass of Python's
    ``TimeoutError``, so ``except TimeoutError`` catches it too."""


class WorkerError(Error, RuntimeError):
    """A worker could not compute its shard (the model rejected the input; its message follows),
    or workers kept dying on this batch."""


class CorruptSegmentError(Error):
    """A shared-memory segment failed validation (not shmgrad's, another version, or damaged)."""


class NoSpaceError(Error, MemoryError):
    """/dev/shm cannot hold the engine's segment; the message says how much was asked
    and is free."""


class NonFiniteError(Error, ArithmeticError):
    """NaN or infinity in the loss or gradient (raised only when asked for)."""


class NodeError(Error, RuntimeError):
    """A step across nodes failed: a peer died or timed out, or failed its own part of the
    step (``rank`` names it when known, else None). After a failed collective (a dead or
    hung peer) the group is broken and every later call raises this at once; after a peer's
    own failure (it raised its error, every node joined the all-reduce) the group still
    works. The local engine works either way and closes cleanly."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


class ConsistencyError(Error):
    """Nodes that should hold bit-identical parameters do not (``rank``: the first that
    differs from rank 0). The process group still works."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


class EngineOSError(Error, OSError):
    """An operating-system call failed (a subclass of ``OSError``)."""


_BY_KIND = {
    "InvalidArgument": InvalidArgumentError,
    "NotFound": EngineNotFoundError,
    "Busy": BusyError,
    "Timeout": EngineTimeoutError,
    "WorkerFailed": WorkerError,
    "Corrupt": CorruptSegmentError,
    "NoSpace": NoSpaceError,
    "NonFinite": NonFiniteError,
    "System": EngineOSError,
}


def error_class(kind):
    """The exception class for a native error kind (used by the extension)."""
    return _BY_KIND.get(kind, Error)
