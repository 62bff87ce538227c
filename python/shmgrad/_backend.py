"""The ``shmgrad`` torch.distributed backend, registered when shmgrad is imported.

``dist.init_process_group("shmgrad")`` (or ``"cpu:shmgrad,cuda:nccl"``) then reduces CPU
tensors through one shared-memory segment per group (docs/BACKEND.md): the collectives
themselves are C++ (``backend/process_group.cc``), reached by DDP's reducer without Python.
"""

import torch.distributed as dist

from ._native import _C

NAME = "shmgrad"


def register() -> None:
    """Registers the backend with torch.distributed (once; importing shmgrad does it).

    It is registered for CPU and CUDA so that a CUDA tensor given to a ``"shmgrad"``
    group gets an error naming the fix (``"cpu:shmgrad,cuda:nccl"``) instead of torch's
    "no backend for device"."""
    if not dist.is_available():  # pragma: no cover - torch built without distributed
        return
    if NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(NAME, _C.create_process_group_backend, devices=["cpu", "cuda"])
