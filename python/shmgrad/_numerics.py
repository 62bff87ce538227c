"""The trainer's torch numerics, for the workers: each worker computes with the float32
matmul precision and the cuDNN settings (TF32, benchmark, determinism) the trainer had when
the engine started, so that its matmuls and convolutions round as the trainer's would.
The text is ``shmgrad serve --numerics``'s, parsed and checked in C++ (ipc::parseNumerics)
and stored in the segment; the C++ worker applies it with worker::applyNumerics, an eager
worker with :func:`apply`."""

import torch

# The keys of the text, in its order; their torch settings.
_CUDNN = (
    ("cudnn_tf32", "allow_tf32"),
    ("cudnn_benchmark", "benchmark"),
    ("cudnn_deterministic", "deterministic"),
)


def spec() -> str:
    """This process's settings as ``serve --numerics`` takes them."""
    cudnn = torch.backends.cudnn
    items = [f"matmul_precision={torch.get_float32_matmul_precision()}"]
    items += [f"{key}={int(bool(getattr(cudnn, attr)))}" for key, attr in _CUDNN]
    return ",".join(items)


def apply(text: str) -> None:
    """Makes this process compute with ``text`` (the engine's, already checked in C++);
    the empty text (an engine served without --numerics) leaves torch's defaults."""
    if not text:
        return
    values = dict(item.split("=", 1) for item in text.split(","))
    torch.set_float32_matmul_precision(values["matmul_precision"])
    for key, attr in _CUDNN:
        setattr(torch.backends.cudnn, attr, values[key] == "1")
