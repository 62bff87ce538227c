"""Engines on several nodes: each node reduces its batch in shared memory, as on one
machine, and its trainer all-reduces the node's reduced gradient with the other nodes'
through ``torch.distributed`` (the hierarchical shape of NCCL and Horovod: only one
process per node talks to the network, once per step, on one flat buffer).

:class:`NodeGroup` is what ``shmgrad.Engine(..., process_group=pg)`` and
``shmgrad.attach(name, ..., process_group=pg)`` build. Its phases, in the order a node
meets them, are collective (every node calls them, in the same order):

* construction: every node gathers every node's parameter and buffer layout and refuses
  a different one (:class:`~shmgrad.InvalidArgumentError` naming the rank and the first
  differing parameter), then takes rank 0's parameters and buffers (broadcasts);
* :meth:`NodeGroup.broadcast_parameters` (from ``bind()``): rank 0's parameters and
  buffers again;
* :meth:`NodeGroup.gradient` (from ``gradient()``): the node's own step, then the
  all-reduce of the whole reduced gradient together with a small record ``[examples,
  loss sum, non-finite, failed per rank]``: one call on a staging copy of both when the
  gradient is small, else one call on the gradient in place (or one per bucket of
  ``bucket_cap_mb``) and one on the record, issued together; a mean is taken over the
  global count after the all-reduce; a model with buffers (BatchNorm statistics) then
  takes those of the first node that computed (DDP's rule: rank 0's);
* :meth:`NodeGroup.check_consistency`: a checksum of the parameters, compared.

Errors of the process group (a dead peer, the group's timeout) become
:class:`~shmgrad.NodeError`, naming the rank when it is known. Nothing here owns the
process group: the caller creates and destroys it.
"""

import hashlib
import os
import socket
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import errors
from ._native import _C

# The timeout this package gives a process group it creates (shmgrad.dask.run, the
# examples): a step whose peer is gone or hung raises NodeError within it. The first
# collective (at Engine construction) also waits this long for the slowest node's engine.
DEFAULT_TIMEOUT_S = 120.0
# A peer's death is seen on the socket a little before its process is gone from /proc.
DEAD_PEER_GRACE_S = 1.0
DEAD_PEER_POLL_S = 0.02
# A gradient up to this size is copied, with the record, into one staging buffer and
# all-reduced in one call: on loopback the two copies cost less than a second
# collective's latency. A larger one is all-reduced in place.
STAGED_MAX_BYTES = 256 * 1024
# The small record all-reduced with each step's gradient: loss sum, non-finite count, the
# mean's count (examples, or forward's counts), then each rank's examples, then each
# rank's "failed" flag (3 + 2 x nodes values).
_LOSS_SUM, _NONFINITE, _WEIGHT, _COUNTS = 0, 1, 2, 3
_CHECKSUM_BYTES = 8
_GPU_ONLY_BACKENDS = ("nccl",)
_CPU = torch.device("cpu")


class NodeStats:
    """The figures of one step across nodes, read through :class:`shmgrad.GradientStats`:
    the global ``num_examples``, ``count``, ``loss``, ``loss_sum``, ``nonfinite``, this node's
    ``local_num_examples`` and ``local_loss_sum``, the all-reduce's ``allreduce_seconds``
    and ``allreduce_bytes`` (the buffers all-reduced: the whole reduced gradient, padding
    included, and the small record), the number of ``nodes``, and ``unused_params``: the
    parameters (indices) no node's backward reached."""

    __slots__ = (
        "num_examples",
        "count",
        "loss",
        "loss_sum",
        "nonfinite",
        "local_num_examples",
        "local_loss_sum",
        "allreduce_seconds",
        "allreduce_bytes",
        "nodes",
        "unused_params",
    )

    def __init__(
        self,
        num_examples,
        loss,
        loss_sum,
        nonfinite,
        local_num_examples,
        local_loss_sum,
        allreduce_seconds,
        allreduce_bytes,
        nodes,
        count=None,
        unused_params=(),
    ):
        self.num_examples = num_examples
        self.count = num_examples if count is None else count
        self.loss = loss
        self.loss_sum = loss_sum
        self.nonfinite = nonfinite
        self.local_num_examples = local_num_examples
        self.local_loss_sum = local_loss_sum
        self.allreduce_seconds = allreduce_seconds
        self.allreduce_bytes = allreduce_bytes
        self.nodes = nodes
        self.unused_params = unused_params


# The native statistics of a node that ran no step of its own (its share of the batch was
# empty, or its step failed): the native record, default-constructed (no examples, no
# workers).
NO_LOCAL_STEP = _C.NativeStats()


def shard(batch, rank: int, nodes: int):
    """Node ``rank``'s share of a global ``batch`` (indices, or any tensor or sequence with
    the examples first) among ``nodes`` nodes: the contiguous slice ``[B*rank/nodes,
    B*(rank+1)/nodes)``, the rule the engine's workers use for their shards. Shares differ
    by at most one example; some are empty when the batch has fewer examples than nodes."""
    if not 0 <= rank < nodes:
        raise errors.InvalidArgumentError(f"shard: rank {rank} is not in [0, {nodes})")
    begin, end = _C.shard_bounds(len(batch), nodes, rank)
    return batch[begin:end]


class NodeGroup:
    """One engine's place among the nodes of a ``torch.distributed`` process group: one
    trainer per node. Built by :class:`shmgrad.Client` when given ``process_group``;
    construction is collective (every node builds its group at the same time)."""

    def __init__(
        self,
        process_group,
        trainer,
        parameters: Sequence,
        *,
        engine_name: str,
        bucket_cap_mb: Optional[float] = None,
    ):
        self._grad = trainer.gradient_buffer()
        self._params = trainer.parameter_buffer()
        # A CPU engine's gradient is all-reduced by gloo; a GPU engine's (on its first
        # device) by NCCL, every collective's tensors on that device.
        self._device = self._grad.device
        self._pg = _check_process_group(process_group, self._device)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # NCCL's objects (layouts) go through it
        self.rank = dist.get_rank(self._pg)
        self.size = dist.get_world_size(self._pg)
        self._buffers = _Buffers(trainer.buffer_views(), self._device)
        buckets = _buckets(self._grad, bucket_cap_mb)
        self._failed = _COUNTS + self.size  # where the failed flags start
        # Then one flag a parameter: 1 where this node's backward reached it, so that a
        # parameter every node left alone keeps .grad None everywhere, and one any node
        # reached has its gradient everywhere (the nodes' optimizers step alike).
        self._reached = self._failed + self.size
        self._num_params = len(parameters)
        record = self._reached + self._num_params
        n = self._grad.numel()
        self._record_on_device = None  # NCCL: the record's copy on the device
        on_device = self._device.type != "cpu"
        small = n * self._grad.element_size() <= STAGED_MAX_BYTES
        if not on_device and bucket_cap_mb is None and small:
            # The gradient, then the record (float32: counts exact to 2^24 examples).
            self._staging = torch.zeros(n + record, dtype=self._grad.dtype)
            self._record = self._staging[n:]
            self._collectives = [self._staging]
        else:
            self._staging = None
            self._record = torch.zeros(record, dtype=torch.float64)
            if on_device:
                self._record_on_device = torch.zeros(
                    record, dtype=torch.float64, device=self._device
                )
            first = self._record if self._record_on_device is None else self._record_on_device
            self._collectives = [first] + buckets
        self._fields = self._record.numpy()  # the same memory; element access without torch
        self.allreduce_bytes = sum(t.numel() * t.element_size() for t in self._collectives)
        self._broken: Optional[errors.NodeError] = None
        self._steps = 0
        formats = [f for _, _, f in trainer.parameters()]  # ipc::MemoryFormat's names
        self._peers = self._exchange_layout(list(parameters), formats, engine_name)
        self.broadcast_parameters()

    @property
    def parameters_and_buffers(self) -> List[torch.Tensor]:
        """What must be bit-identical on every node (the checksum's input)."""
        return [self._params] + self._buffers.tensors

    # -- construction -----------------------------------------------------------------
    def _exchange_layout(self, parameters, formats, engine_name):
        """Gathers every node's (host, pid, engine, parameter layout); refuses a layout
        other than rank 0's on every node, naming the rank and the parameter."""
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "engine": engine_name,
            "parameters": [(n, tuple(s)) for n, s in parameters],
            # The order of each parameter's elements in the flat buffer all-reduced.
            "formats": formats,
            "buffers": self._buffers.layout,
            "floats": self._grad.numel(),
            "collectives": [(t.numel(), str(t.dtype)) for t in self._collectives],
        }
        peers: List[dict] = [None] * self.size
        self._collective(
            "exchanging parameter layouts",
            lambda: dist.all_gather_object(peers, mine, group=self._pg),
        )
        for rank, peer in enumerate(peers):
            diff = _layout_difference(peers[0], peer)
            if diff is not None:
                raise errors.InvalidArgumentError(
                    f"rank {rank} (host {peer['host']}, engine {peer['engine']!r}) does not "
                    f"match rank 0: {diff}. Every node must start its engine with the same "
                    "model and options"
                )
        return peers

    def broadcast_parameters(self):
        """Every node takes rank 0's parameters (one broadcast of the whole buffer) and
        buffers, as DDP does at construction, so nodes that started with different weights
        agree."""
        root = _global_rank(self._pg, 0)
        self._collective(
            "broadcasting rank 0's parameters",
            lambda: dist.broadcast(self._params, src=root, group=self._pg),
        )
        self._collective(
            "broadcasting rank 0's buffers", lambda: self._buffers.broadcast(root, self._pg)
        )

    # -- a step -----------------------------------------------------------------------
    def gradient(self, local_step, mean: bool):
        """Runs this node's step (``local_step()``, returning the native statistics; None
        when the node's share is empty), then all-reduces the reduced gradient and the
        step's record with every node. Returns ``(native, NodeStats)``.

        Every node joins the all-reduce whatever happened locally, so that the nodes stay
        in step: a node whose share is empty joins with zeros; one whose step raised joins
        with zeros and a failure flag, then raises its own error, while the others raise
        NodeError naming it."""
        self._check_usable()
        self._steps += 1
        failure = None
        native = NO_LOCAL_STEP
        if local_step is None:
            self._grad.zero_()
        else:
            try:
                native = local_step()
            except errors.Error as exc:
                failure = exc
                native = NO_LOCAL_STEP
                self._grad.zero_()  # this node's part of the sum; nobody applies it
        f = self._fields
        f[:] = 0.0
        f[_COUNTS + self.rank] = native.num_examples
        f[_WEIGHT] = native.count
        f[_LOSS_SUM] = native.loss_sum
        f[_NONFINITE] = 1.0 if native.nonfinite else 0.0
        f[self._failed + self.rank] = 1.0 if failure is not None else 0.0
        reached = f[self._reached : self._reached + self._num_params]
        if native is not NO_LOCAL_STEP:  # no step of its own: it reached none
            reached[:] = 1.0
            unreached = native.unused_params
            if unreached:
                reached[unreached] = 0.0
        t0 = time.perf_counter()
        self._collective(f"all-reducing step {self._steps}", self._allreduce)
        seconds = time.perf_counter() - t0
        if failure is not None:
            raise failure
        failed = [r for r in range(self.size) if f[self._failed + r] != 0]
        if failed:
            raise errors.NodeError(
                f"node group: rank {failed[0]}'s own step failed (it raised its error), so "
                f"step {self._steps}'s gradient is incomplete on every node: do not apply it",
                rank=failed[0],
            )
        counts = f[_COUNTS : _COUNTS + self.size]
        count = int(counts.sum())
        if count == 0:
            raise errors.InvalidArgumentError(
                "empty batch: every node's share was empty; give at least one example"
            )
        loss_sum = float(f[_LOSS_SUM])
        # The mean's denominator: the examples, or forward's counts where they differ
        # (float32: whole counts exact to 2^24).
        weight = float(f[_WEIGHT])
        if mean:
            if weight <= 0:
                raise errors.InvalidArgumentError(
                    f"the global batch's count is {weight}: a mean needs a count > 0"
                )
            self._grad.mul_(_C.mean_scale(weight))
        if self._buffers:  # the statistics of the first node that computed (DDP: rank 0's)
            src = _global_rank(self._pg, int(counts.nonzero()[0][0]))
            self._collective(
                f"broadcasting step {self._steps}'s buffers",
                lambda: self._buffers.broadcast(src, self._pg),
            )
            seconds = time.perf_counter() - t0
        return native, NodeStats(
            num_examples=count,
            count=weight,
            loss=loss_sum / weight if mean else loss_sum,
            loss_sum=loss_sum,
            nonfinite=bool(f[_NONFINITE] != 0),
            local_num_examples=native.num_examples,
            local_loss_sum=native.loss_sum,
            allreduce_seconds=seconds,
            allreduce_bytes=self.allreduce_bytes,
            nodes=self.size,
            unused_params=(
                (reached == 0).nonzero()[0].tolist()
                if self._num_params and reached.min() == 0
                else []
            ),
        )

    def _allreduce(self):
        if self._record_on_device is not None:
            # NCCL: the record goes to the device and back (a few dozen bytes); the
            # collectives run on NCCL's stream after the work issued before them.
            self._record_on_device.copy_(self._record)
            works = [dist.all_reduce(t, group=self._pg, async_op=True) for t in self._collectives]
            for w in works:
                w.wait()
            self._record.copy_(self._record_on_device)  # waits for the all-reduce
            return
        if self._staging is not None:
            n = self._grad.numel()
            self._staging[:n].copy_(self._grad)
            dist.all_reduce(self._staging, group=self._pg)
            self._grad.copy_(self._staging[:n])
            return
        # Issued together: gloo runs them on its own threads, so the small record's
        # latency overlaps the gradient's transfer.
        works = [dist.all_reduce(t, group=self._pg, async_op=True) for t in self._collectives]
        for w in works:
            w.wait()

    # -- consistency ------------------------------------------------------------------
    def check_consistency(self) -> int:
        """Compares the checksum of the parameters and buffers across nodes (collective).
        Returns it when every node has the same; raises ConsistencyError naming the first
        rank that differs."""
        self._check_usable()
        mine = torch.tensor(
            [checksum(self.parameters_and_buffers)], dtype=torch.int64, device=self._device
        )
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        self._collective(
            "comparing parameter checksums", lambda: dist.all_gather(every, mine, group=self._pg)
        )
        differ = [r for r, c in enumerate(every) if int(c) != int(every[0])]
        if differ:
            raise errors.ConsistencyError(
                f"node group: the parameters of rank(s) {differ} differ from rank 0's "
                "(checksums "
                + ", ".join(f"{r}: {int(c):#018x}" for r, c in enumerate(every))
                + "): every node must apply the same optimizer to the same gradient",
                rank=differ[0],
            )
        return int(mine)

    # -- failures ---------------------------------------------------------------------
    def _check_usable(self):
        if self._broken is not None:
            raise errors.NodeError(
                f"node group: unusable since an earlier failure ({self._broken}); close "
                "the engine and start again with a new process group",
                rank=self._broken.rank,
            )

    def _collective(self, what, fn):
        """Runs ``fn`` (collective calls); a process-group error becomes NodeError (the
        group is broken from then on)."""
        self._check_usable()
        try:
            return fn()
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out ..."
            rank = self._lost_peer()
            who = f"rank {rank} failed" if rank is not None else "a peer failed or timed out"
            err = errors.NodeError(
                f"node group: {who} while {what} on rank {self.rank} of {self.size} ({exc})",
                rank=rank,
            )
            self._broken = err
            raise err from exc

    def _lost_peer(self) -> Optional[int]:
        """The rank that is gone, when that can be known: the only other rank, or a rank
        on this host whose process has exited."""
        others = [r for r in range(self.size) if r != self.rank]
        if len(others) == 1:
            return others[0]
        peers = getattr(self, "_peers", None)
        if peers is None:
            return None
        here = socket.gethostname()
        local = [r for r in others if peers[r]["host"] == here]
        deadline = time.monotonic() + DEAD_PEER_GRACE_S
        while True:
            gone = [r for r in local if not _process_alive(peers[r]["pid"])]
            if gone or time.monotonic() > deadline:
                return gone[0] if gone else None
            time.sleep(DEAD_PEER_POLL_S)


# -- helpers --------------------------------------------------------------------------
def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """A 64-bit checksum (BLAKE2b) of tensors' bytes (a GPU tensor's copied to the host),
    in order: equal only for bit-identical contents, as far as 64 bits tell."""
    digest = hashlib.blake2b(digest_size=_CHECKSUM_BYTES)
    for t in tensors:
        digest.update(memoryview(t.detach().cpu().contiguous().numpy()).cast("B"))
    return int.from_bytes(digest.digest(), "little", signed=True)


class _Buffers:
    """The engine's shared buffers (BatchNorm statistics), broadcast as one flat tensor per
    dtype (on `device`: the collectives' device): a copy into it, one broadcast, a copy
    back."""

    def __init__(self, views, device=_CPU):
        self.tensors = [t for _, t in views]
        self.layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in views]
        self._groups = []
        for dtype in sorted({t.dtype for t in self.tensors}, key=str):
            members = [t for t in self.tensors if t.dtype == dtype]
            flat = torch.zeros(sum(t.numel() for t in members), dtype=dtype, device=device)
            self._groups.append(
                (members, flat, list(torch.split(flat, [t.numel() for t in members])))
            )

    def __bool__(self):
        return bool(self.tensors)

    def broadcast(self, src, pg):
        for members, flat, parts in self._groups:
            for t, part in zip(members, parts):
                part.copy_(t.reshape(-1))
            dist.broadcast(flat, src=src, group=pg)
            for t, part in zip(members, parts):
                t.copy_(part.view_as(t))


def _check_process_group(pg, device=_CPU):
    if not dist.is_available() or not dist.is_initialized():
        raise errors.InvalidArgumentError(
            "process_group: torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo', ...) first (torchrun sets the "
            "environment it reads), or use shmgrad.dask.run"
        )
    if not isinstance(pg, dist.ProcessGroup):
        raise errors.InvalidArgumentError(
            f"process_group must be a torch.distributed process group (e.g. "
            f"torch.distributed.group.WORLD), got {type(pg).__name__}"
        )
    backend = dist.get_backend(pg)
    if device.type == "cpu" and backend in _GPU_ONLY_BACKENDS:
        raise errors.InvalidArgumentError(
            f"process_group: the {backend} backend reduces GPU tensors, and this engine's "
            "gradient is in host memory: use a gloo group, or give the engine devices= "
            "(GPU workers) (see docs/MULTINODE.md)"
        )
    if device.type == "cuda" and backend not in _GPU_ONLY_BACKENDS:
        raise errors.InvalidArgumentError(
            f"process_group: this engine's gradient is on {device}, and the {backend} "
            "backend would take it through the host: use an nccl group "
            "(torch.distributed.init_process_group('nccl', ...)), one rank per node"
        )
    if dist.get_rank(pg) < 0:
        raise errors.InvalidArgumentError("process_group: this process is not a member of it")
    return pg


def _global_rank(pg, group_rank):
    if pg is dist.group.WORLD or pg is None:
        return group_rank
    return dist.get_global_rank(pg, group_rank)


def _buckets(grad, bucket_cap_mb):
    if bucket_cap_mb is None:
        return [grad]
    if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise errors.InvalidArgumentError(
            f"bucket_cap_mb must be a positive number of MiB (or None: one all-reduce of the "
            f"whole gradient), got {bucket_cap_mb!r}"
        )
    per = max(1, int(bucket_cap_mb * 2**20) // grad.element_size())
    return [grad[i : i + per] for i in range(0, grad.numel(), per)]


def _layout_difference(want, got) -> Optional[str]:
    """How ``got``'s parameter layout differs from ``want``'s (rank 0's), or None."""
    a, b = want["parameters"], got["parameters"]
    for i, (pa, pb) in enumerate(zip(a, b)):
        if pa != pb:
            return f"parameter {i} is {pb[0]!r} {pb[1]} there but {pa[0]!r} {pa[1]} on rank 0"
    if len(a) != len(b):
        return f"it has {len(b)} parameters, rank 0 has {len(a)}"
    for i, (fa, fb) in enumerate(zip(want["formats"], got["formats"])):
        if fa != fb:
            return (
                f"parameter {i} {a[i][0]!r} is laid out {fb} there but {fa} on rank 0 "
                "(the flat buffers would be summed in different orders): convert the model "
                "alike on every node, e.g. model.to(memory_format=torch.channels_last), "
                "before starting its engine"
            )
    if want["buffers"] != got["buffers"]:
        return f"its buffers are {got['buffers'][:4]}..., rank 0's {want['buffers'][:4]}..."
    if want["floats"] != got["floats"]:
        return f"its parameter buffer holds {got['floats']} floats, rank 0's {want['floats']}"
    if want["collectives"] != got["collectives"]:
        return (
            f"it all-reduces in {len(got['collectives'])} call(s) of "
            f"{[c[0] for c in got['collectives']]} values, rank 0 in "
            f"{[c[0] for c in want['collectives']]}: give every node the same bucket_cap_mb"
        )
    return None


def _process_alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # a zombie has exited
