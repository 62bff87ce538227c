"""What one gradient call did: :class:`GradientStats`, read from the native result only
when a field is asked for."""

from typing import List

from . import multinode
from ._native import _C


class GradientStats:
    """What one :meth:`Client.gradient` call did. Fields are read from the native result
    only when asked for, so a training loop that ignores them pays nothing for them.

    ``num_examples``, ``count`` (the mean's denominator: ``num_examples``, or the sum of the
    counts ``forward`` returned), ``loss`` (the sum, or the mean with ``reduction="mean"``),
    ``loss_sum``, ``wall_seconds`` (the call, as the engine timed it), ``reduce_seconds``
    (slowest worker's slice), ``retries``, ``nonfinite``; per worker that took part, in rank
    order: ``compute_seconds``, ``reduce_seconds_per_worker``, ``reduce_early_seconds`` (of
    its reduction, what it did before the last worker finished computing: bucketed steps),
    ``wait_seconds``, ``worker_examples``, ``worker_slots``, ``nonfinite_workers``;
    ``workers`` is how many.
    ``unused_params``: the parameters (indices, ``named_parameters()`` order) that no
    participant's backward reached, whose ``.grad`` the bound module leaves None.
    Where the wall time went: ``prepare_seconds`` (checks, batch copy), ``step_seconds``
    (publish to the end of the reduction), ``wake_seconds`` (publish to the last worker
    starting), ``finish_seconds`` (end of the reduction to return). ``placement_probing``:
    with ``workers="auto"``, the step was one of the placement probe's (or of a recheck of
    the kept placement).

    Across nodes (an engine with a ``process_group``), ``num_examples``, ``loss``,
    ``loss_sum`` and ``nonfinite`` are the global batch's; ``local_num_examples`` and
    ``local_loss_sum`` this node's, ``allreduce_seconds`` the all-reduce's (not in
    ``wall_seconds``, which is the node's own step), ``allreduce_bytes`` the bytes it
    all-reduced, ``nodes`` how many. On one node these are the same figures, 0.0, 0 and 1.
    """

    __slots__ = ("_native", "_nodes")
    # The native record's scalar fields (engine/trainer.h's field list), read by name.
    _SCALARS = tuple(
        f for f, kind, _ in _C.RECORDS["GradientStats"] if kind != "list:WorkerStepStats"
    )
    _NODE_FIELDS = multinode.NodeStats.__slots__
    _ONE_NODE = {"local_num_examples": "num_examples", "local_loss_sum": "loss_sum"}
    _ONE_NODE_CONSTANTS = {"allreduce_seconds": 0.0, "allreduce_bytes": 0, "nodes": 1}

    def __init__(self, native, nodes=None):
        self._native = native
        self._nodes = nodes  # a multinode.NodeStats across nodes, None on one node

    def __getattr__(self, name):
        if self._nodes is not None and name in GradientStats._NODE_FIELDS:
            return getattr(self._nodes, name)
        if name in GradientStats._SCALARS:
            return getattr(self._native, name)
        if name in GradientStats._ONE_NODE:
            return getattr(self._native, GradientStats._ONE_NODE[name])
        if name in GradientStats._ONE_NODE_CONSTANTS:
            return GradientStats._ONE_NODE_CONSTANTS[name]
        raise AttributeError(f"GradientStats has no field {name!r}")

    def _column(self, field):
        return [getattr(w, field) for w in self._native.workers]

    @property
    def workers(self) -> int:
        return len(self._native.workers)

    @property
    def worker_slots(self) -> List[int]:
        return self._column("slot")

    @property
    def worker_examples(self) -> List[int]:
        return self._column("examples")

    @property
    def compute_seconds(self) -> List[float]:
        return self._column("compute_seconds")

    @property
    def reduce_seconds_per_worker(self) -> List[float]:
        return self._column("reduce_seconds")

    @property
    def reduce_early_seconds(self) -> List[float]:
        return self._column("reduce_early_seconds")

    @property
    def wait_seconds(self) -> List[float]:
        return self._column("wait_seconds")

    @property
    def nonfinite_workers(self) -> List[int]:
        return [w.slot for w in self._native.workers if w.nonfinite_loss or w.nonfinite_grad]

    def as_dict(self) -> dict:
        """Every field as a plain dict (e.g. for logging)."""
        names = tuple(dict.fromkeys(self._SCALARS + self._NODE_FIELDS)) + (
            "workers",
            "worker_slots",
            "worker_examples",
            "compute_seconds",
            "reduce_seconds_per_worker",
            "reduce_early_seconds",
            "wait_seconds",
            "nonfinite_workers",
        )
        return {n: getattr(self, n) for n in names}

    def __repr__(self):
        return (
            f"GradientStats(num_examples={self.num_examples}, loss={self.loss:.6g}, "
            f"workers={self.workers}, wall_seconds={self.wall_seconds:.6f}, "
            f"retries={self.retries})"
        )
