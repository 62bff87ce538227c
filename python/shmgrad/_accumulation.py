"""``gradient(..., accumulate=True)``: which of the engine's two reduced gradients holds
the last result, what it is the sum or the mean over, and how the next micro-batch is
added to it, on one node (the workers add it while reducing) and across nodes (the
trainer adds each all-reduced micro-batch)."""

import torch

from . import errors
from ._native import _C

# ipc::Accumulate (ipc/layout.h): a fresh result into the first set, or the previous result
# (in one set) plus this step's into the other.
FRESH, REDUCED_TO_ACCUM, ACCUM_TO_REDUCED = 0, 1, 2


class Accumulation:
    """The state one client keeps between gradient calls. ``grad_sets`` are the engine's
    two reduced gradients: a fresh step writes the first; accumulating steps on one node
    alternate (each reads the previous result and writes the other one, so a step that is
    retried re-reads an intact result); across nodes the all-reduce works on the first,
    and micro-batches are added to the second."""

    def __init__(self, grad_sets):
        self.grad_sets = grad_sets
        self.current = 0  # the set that holds the last result
        self._count = 0.0  # what the last result is the sum or mean over
        self._mean = None  # its reduction; None: no result yet
        self._loss_scale = 1.0  # and its loss scale

    @property
    def views(self):
        """The reduced gradient that holds the last result."""
        return self.grad_sets[self.current]

    def begin(self, accumulate, mean, scale, across_nodes, grad_dropped):
        """A step about to run: ``(mode, prev_count, onto_nodes)``: what the workers are to
        do with the previous result (an ``ipc::Accumulate``), the count it is over, and
        whether the trainer adds this result to it after the all-reduce. A call with
        ``accumulate`` adds to the results since the last call without it, unless
        ``optimizer.zero_grad()`` dropped (``grad_dropped()``) or zeroed them."""
        if not accumulate or not self._has_result(grad_dropped):
            return FRESH, 0.0, False
        if self._mean != mean:
            raise errors.InvalidArgumentError(
                f"accumulate=True adds to a result of reduction="
                f"{'mean' if self._mean else 'sum'!r}: give the same reduction to "
                "every call of one accumulation"
            )
        if self._loss_scale != scale:
            raise errors.InvalidArgumentError(
                f"accumulate=True adds to a result of loss_scale={self._loss_scale}, "
                f"but this call's is {scale}: give the same loss scale to every call of one "
                "accumulation (call the GradScaler's update() only after its step())"
            )
        if not across_nodes:
            return (REDUCED_TO_ACCUM if self.current == 0 else ACCUM_TO_REDUCED), self._count, False
        # The all-reduce works on the first set: the previous (global) result moves to the
        # second once, and each micro-batch is added to it there.
        if self.current == 0:
            for a, r in zip(self.grad_sets[1], self.grad_sets[0]):
                a.copy_(r)
        return FRESH, self._count, True

    def _has_result(self, grad_dropped) -> bool:
        if self._mean is None:
            return False
        if grad_dropped():
            return False  # zero_grad(set_to_none=True): start afresh
        return any(bool(v.any()) for v in self.views)  # zero_grad(set_to_none=False) zeroes

    def finish(self, mode, onto_nodes, mean, scale, prev_count, count):
        """The step's result is in: where it is, and what it is over."""
        if onto_nodes:
            # accum = a * accum + b * (this micro-batch's global result), weighted as the
            # workers weigh accumulation on one node (ipc/reduce.h's accumulationWeights).
            acc, fresh = self.grad_sets[1], self.grad_sets[0]
            if mean:
                a, b = _C.accumulation_weights(True, prev_count, count, count)
                torch._foreach_mul_(acc, a)
                torch._foreach_add_(acc, fresh, alpha=b)
            else:
                torch._foreach_add_(acc, fresh)
            self.current, self._count = 1, prev_count + count
        elif mode == FRESH:
            self.current, self._count = 0, count
        else:
            self.current, self._count = 1 - self.current, prev_count + count
        self._mean = mean
        self._loss_scale = scale
