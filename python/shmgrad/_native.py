"""The native extension ``shmgrad._C``, with a clear error when it is not built."""

try:
    from . import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without set-up
    raise ImportError(
        "shmgrad's native module is not built: run tools/setup.sh from the shmgrad checkout "
        f"({exc})"
    ) from exc
