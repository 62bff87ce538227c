"""The ``shmgrad`` torch.distributed backend, registered when shmgrad is imported.

``dist.init_process_group("shmgrad")`` (or ``"cpu:shmgrad,cuda:nccl"``) then reduces CPU
tensors through one shared-memory segment per node and group (docs/BACKEND.md): the
collectives themselves are C++ (``backend/process_group.cc``), reached by DDP's reducer
without Python. This module only creates groups: it finds which ranks share a node and,
when there are several nodes, the gloo groups between them.
"""

import os
import socket

import torch.distributed as dist

from ._native import _C

NAME = "shmgrad"


def _node_key() -> str:
    """What ranks of one node have in common: the host, its boot, and torchrun's node rank
    (so that two "nodes" started on one machine stay apart, as on two machines)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        boot = ""
    return f"{socket.gethostname()}/{boot}/{os.environ.get('GROUP_RANK', '')}"


def _create(store, rank, size, timeout):
    """The creator torch.distributed calls for each new group (store, rank, size, timeout):
    every rank publishes its node; each node's ranks share a segment; across nodes, the
    first rank of each node joins a gloo group of the nodes' first ranks (all-reduce,
    broadcast, barrier: shared memory within, gloo between) and every rank a gloo group of
    all (the other collectives)."""
    # DDP's reducer allocates its gradient buckets through the group's backend (c10d's
    # allocateTensor: here, in this rank's arena, all-reduced in place) only when
    # DDP_DISABLE_COMM_MEM is 0; torch's default is 1. A user's own setting stands.
    os.environ.setdefault("DDP_DISABLE_COMM_MEM", "0")
    # A torchrun restart reuses the agent's store and the group's prefix: the attempt keeps
    # its keys apart from the last one's.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    prefix = f"shmgrad/attempt{attempt}/" if attempt is not None else "shmgrad/"
    store.set(f"{prefix}host/{rank}", _node_key())
    hosts = [store.get(f"{prefix}host/{r}").decode() for r in range(size)]
    index: dict = {}
    node_of_rank = [index.setdefault(h, len(index)) for h in hosts]
    leaders = everyone = None
    if len(index) > 1:
        node = node_of_rank[rank]
        everyone = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix + "everyone/", store), rank, size, timeout
        )
        if node_of_rank.index(node) == rank:  # this node's first rank
            leaders = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix + "leaders/", store), node, len(index), timeout
            )
    return _C.create_process_group_backend(
        store, rank, size, timeout, prefix, node_of_rank, leaders, everyone
    )


def register() -> None:
    """Registers the backend with torch.distributed (once; importing shmgrad does it).

    It is registered for CPU and CUDA so that a CUDA tensor given to a ``"shmgrad"``
    group gets an error naming the fix (``"cpu:shmgrad,cuda:nccl"``) instead of torch's
    "no backend for device"."""
    if not dist.is_available():  # pragma: no cover - torch built without distributed
        return
    if NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
