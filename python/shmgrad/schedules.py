"""Adaptive batch-size schedules (Sievert & Charles, "Improving the convergence of SGD
through adaptive batch sizes").

A schedule says how many examples the next model update should use. Growing the batch
as training goes on reduces the gradient noise the way a decaying learning rate does, but
with fewer, larger (and so better parallelised) updates. Four schedules:

* :class:`Constant` -- ``B = batch_size`` (the usual fixed batch, for comparison).
* :class:`PadaDamp` -- ``B_k = ceil(B0 + rate * k)`` at model update ``k`` (0-based).
* :class:`GeoDamp` -- ``B = B0 * factor ** floor(epoch / delay_epochs)``, rounded up.
* :class:`AdaDamp` -- ``B_k = ceil(B0 * F(x_0) / F(x_k))``, where ``F`` is the training
  loss, estimated on a fixed sample through the engine (:meth:`AdaDamp.update_loss`).

The contract, common to all four:

* ``schedule.virtual_batch_size(step=k, epoch=e)`` is the batch size the schedule asks
  for (it keeps growing without bound).
* ``schedule.batch_size(step=k, epoch=e)`` is the batch to actually use:
  ``min(virtual, max_batch_size)``.
* ``schedule.lr_scale(step=k, epoch=e)`` is the factor to multiply the base learning rate
  by: ``1`` while the virtual batch fits under ``max_batch_size``, then
  ``max_batch_size / virtual`` -- past the cap the batch stops growing and the learning
  rate decays instead, which has the same effect on the gradient noise (as in the paper).
* ``schedule(step=k, epoch=e)`` returns ``(batch_size, lr_scale)`` in one call.

``step`` is the number of model updates done so far (0 for the first), ``epoch`` the number
of passes over the training set done so far (an int, or a float for a fractional epoch).
Both are keyword-only; a schedule that needs one (``step`` for :class:`PadaDamp`,
``epoch`` for :class:`GeoDamp`) raises :class:`~shmgrad.InvalidArgumentError` without it,
the others ignore them. ``max_batch_size`` is keyword-only, and a bad argument raises
:class:`~shmgrad.InvalidArgumentError` naming it.

Rounding up is tolerant of floating-point error: a value within ``1e-9`` (relative) of an
integer counts as that integer, so ``ceil(32 + 0.1 * 30)`` is 35, not 36.

Typical use with an engine (the learning rate is set every step)::

    sched = shmgrad.schedules.GeoDamp(64, 2, 1, max_batch_size=1024)
    opt = torch.optim.SGD(model.parameters(), lr=base_lr)
    step, seen = 0, 0
    while seen < epochs * n:
        bs, lr_factor = sched(step=step, epoch=seen // n)
        for g in opt.param_groups:
            g["lr"] = base_lr * lr_factor
        engine.gradient(next_indices(bs), reduction="mean")
        opt.step()
        step, seen = step + 1, seen + bs
"""

import math
import numbers
from typing import Optional, Tuple

from . import errors

__all__ = ["Schedule", "Constant", "PadaDamp", "GeoDamp", "AdaDamp"]

_REL_TOL = 1e-9


def _ceil(x: float) -> int:
    """``ceil(x)``, but a value within a relative 1e-9 of an integer is that integer."""
    r = round(x)
    if abs(x - r) <= _REL_TOL * max(1.0, abs(x)):
        return int(r)
    return int(math.ceil(x))


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _positive_int(name: str, v) -> int:
    if not _is_int(v) or v < 1:
        raise errors.InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _real(name: str, v, *, minimum: float, strict: bool = False) -> float:
    ok = _is_real(v) and math.isfinite(v) and (v > minimum if strict else v >= minimum)
    if not ok:
        cmp = ">" if strict else ">="
        raise errors.InvalidArgumentError(
            f"{name} must be a finite number {cmp} {minimum:g}, got {v!r}"
        )
    return float(v)


class Schedule:
    """Base class of the batch-size schedules; see the module docstring for the contract.

    Subclasses implement :meth:`virtual_batch_size`. ``max_batch_size`` (``None``: no cap)
    is the largest batch :meth:`batch_size` returns; it must be at least the initial batch
    size.
    """

    def __init__(self, initial: int, max_batch_size: Optional[int]):
        self._initial = initial
        if max_batch_size is not None:
            max_batch_size = _positive_int("max_batch_size", max_batch_size)
            if max_batch_size < initial:
                raise errors.InvalidArgumentError(
                    f"max_batch_size must be >= the initial batch size {initial}, "
                    f"got {max_batch_size!r}"
                )
        self.max_batch_size = max_batch_size

    # -- argument checks shared by the subclasses ------------------------------------
    @staticmethod
    def _check_step(step, required: bool) -> Optional[int]:
        if step is None:
            if required:
                raise errors.InvalidArgumentError(
                    "step is required (the number of model updates so far)"
                )
            return None
        if not _is_int(step) or step < 0:
            raise errors.InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        return int(step)

    @staticmethod
    def _check_epoch(epoch, required: bool) -> Optional[float]:
        if epoch is None:
            if required:
                raise errors.InvalidArgumentError("epoch is required (passes over the data so far)")
            return None
        if not _is_real(epoch) or not math.isfinite(epoch) or epoch < 0:
            raise errors.InvalidArgumentError(f"epoch must be a finite number >= 0, got {epoch!r}")
        return epoch

    # -- the contract -------------------------------------------------------------------
    def virtual_batch_size(self, *, step: Optional[int] = None, epoch=None) -> int:
        """The batch size the schedule asks for at ``step``/``epoch``, ignoring the cap."""
        raise NotImplementedError

    def batch_size(self, *, step: Optional[int] = None, epoch=None) -> int:
        """The batch to use: the virtual batch size, capped at ``max_batch_size``."""
        b = self.virtual_batch_size(step=step, epoch=epoch)
        return b if self.max_batch_size is None else min(b, self.max_batch_size)

    def lr_scale(self, *, step: Optional[int] = None, epoch=None) -> float:
        """Factor for the base learning rate: 1 under the cap, ``max_batch_size / virtual``
        past it (at most 1, shrinking as the virtual batch keeps growing)."""
        b = self.virtual_batch_size(step=step, epoch=epoch)
        if self.max_batch_size is None or b <= self.max_batch_size:
            return 1.0
        return self.max_batch_size / b

    def __call__(self, *, step: Optional[int] = None, epoch=None) -> Tuple[int, float]:
        """``(batch_size, lr_scale)`` at ``step``/``epoch`` in one call."""
        b = self.virtual_batch_size(step=step, epoch=epoch)
        if self.max_batch_size is None or b <= self.max_batch_size:
            return b, 1.0
        return self.max_batch_size, self.max_batch_size / b

    def _cap_repr(self) -> str:
        return "" if self.max_batch_size is None else f", max_batch_size={self.max_batch_size}"


class Constant(Schedule):
    """A fixed batch: ``B = batch_size`` at every step (``lr_scale`` is always 1).

    Args:
        batch_size: positive int.
    """

    def __init__(self, batch_size: int):
        batch_size = _positive_int("batch_size", batch_size)
        super().__init__(batch_size, None)
        self.B0 = batch_size

    def virtual_batch_size(self, *, step=None, epoch=None) -> int:
        self._check_step(step, False)
        self._check_epoch(epoch, False)
        return self.B0

    def __repr__(self):
        return f"Constant({self.B0})"


class PadaDamp(Schedule):
    """Linear growth with the number of model updates: ``B_k = ceil(B0 + rate * k)``.

    Args:
        B0: initial batch size (positive int), the batch of update 0.
        rate: examples added per model update (finite, >= 0).
        max_batch_size (keyword-only): cap; past it the learning rate is scaled by
            ``max_batch_size / B_k`` instead. ``None`` (default): no cap.

    Needs ``step`` (model updates so far); ignores ``epoch``.
    """

    def __init__(self, B0: int, rate: float, *, max_batch_size: Optional[int] = None):  # noqa: N803
        self.B0 = _positive_int("B0", B0)
        self.rate = _real("rate", rate, minimum=0.0)
        super().__init__(self.B0, max_batch_size)

    def virtual_batch_size(self, *, step=None, epoch=None) -> int:
        k = self._check_step(step, True)
        self._check_epoch(epoch, False)
        return _ceil(self.B0 + self.rate * k)

    def __repr__(self):
        return f"PadaDamp({self.B0}, {self.rate:g}{self._cap_repr()})"


class GeoDamp(Schedule):
    """Geometric growth every ``delay_epochs`` epochs:
    ``B = ceil(B0 * factor ** floor(epoch / delay_epochs))``.

    Args:
        B0: initial batch size (positive int).
        factor: growth factor (finite, >= 1).
        delay_epochs: epochs between growths (finite, > 0; may be fractional).
        max_batch_size (keyword-only): cap; past it the learning rate is scaled by
            ``max_batch_size / B`` instead. ``None`` (default): no cap.

    Needs ``epoch`` (passes over the data so far, an int or a float); ignores ``step``.
    """

    def __init__(
        self,
        B0: int,
        factor: float,
        delay_epochs: float,
        *,  # noqa: N803
        max_batch_size: Optional[int] = None,
    ):
        self.B0 = _positive_int("B0", B0)
        self.factor = _real("factor", factor, minimum=1.0)
        self.delay_epochs = _real("delay_epochs", delay_epochs, minimum=0.0, strict=True)
        super().__init__(self.B0, max_batch_size)

    def virtual_batch_size(self, *, step=None, epoch=None) -> int:
        self._check_step(step, False)
        e = self._check_epoch(epoch, True)
        # floor(e / delay) with the same tolerance as _ceil: 0.3 / 0.1 is 3, not 2.
        q = e / self.delay_epochs
        r = round(q)
        k = int(r) if abs(q - r) <= _REL_TOL * max(1.0, abs(q)) else int(math.floor(q))
        if self.factor.is_integer():  # exact, however large
            return self.B0 * int(self.factor) ** k
        try:
            return _ceil(self.B0 * self.factor**k)
        except OverflowError:
            raise errors.InvalidArgumentError(
                f"epoch {epoch!r} is too large: the batch size overflows a float"
            ) from None

    def __repr__(self):
        return f"GeoDamp({self.B0}, {self.factor:g}, {self.delay_epochs:g}{self._cap_repr()})"


class AdaDamp(Schedule):
    """Batch size inversely proportional to the training loss:
    ``B_k = ceil(B0 * F(x_0) / F(x_k))``.

    ``F`` is estimated on demand: :meth:`update_loss` records a loss value (the first one
    recorded is ``F(x_0)``); :meth:`virtual_batch_size` uses the latest. Before any loss is
    recorded the batch is ``B0``. Ignores ``step`` and ``epoch``. The paper's AdaDamp
    assumes the optimal loss is 0, as it nearly is for a classifier's cross-entropy.

    Args:
        B0: initial batch size (positive int).
        max_batch_size (keyword-only): cap; past it the learning rate is scaled by
            ``max_batch_size / B_k`` instead. ``None`` (default): no cap.
    """

    def __init__(self, B0: int, *, max_batch_size: Optional[int] = None):  # noqa: N803
        self.B0 = _positive_int("B0", B0)
        super().__init__(self.B0, max_batch_size)
        self.initial_loss: Optional[float] = None
        self.loss: Optional[float] = None

    def update_loss(
        self, engine=None, sample_indices=None, *, loss: Optional[float] = None, **gradient_kwargs
    ) -> float:
        """Records the current training loss ``F(x_k)``; returns it.

        Either give ``loss`` (a finite value > 0, e.g. a running mean you already have),
        or ``engine`` and ``sample_indices``: the mean loss over that (fixed) sample of the
        engine's dataset is computed with ``engine.gradient(sample_indices,
        reduction="mean", **gradient_kwargs)``.

        .. note:: That call overwrites the engine's reduced gradient (the ``.grad`` of a
           bound module), so call it between ``optimizer.step()`` and the next
           :meth:`~shmgrad.Engine.gradient`, never in between. It costs one forward and
           backward pass over the sample; a sample of a few hundred examples every few
           hundred updates is plenty.

        Raises:
            InvalidArgumentError: neither or both of ``loss`` and ``engine``, no
                ``sample_indices``, or a loss that is not finite and > 0.
        """
        if loss is not None:
            if engine is not None or sample_indices is not None:
                raise errors.InvalidArgumentError(
                    "give either loss or engine and sample_indices to update_loss, not both"
                )
        else:
            if engine is None:
                raise errors.InvalidArgumentError(
                    "update_loss needs a loss value or an engine and sample_indices"
                )
            if sample_indices is None:
                raise errors.InvalidArgumentError(
                    "sample_indices is required with engine (a fixed sample of the dataset)"
                )
            if "reduction" in gradient_kwargs:
                raise errors.InvalidArgumentError(
                    "update_loss always uses reduction='mean'; do not pass reduction"
                )
            loss = engine.gradient(sample_indices, reduction="mean", **gradient_kwargs).loss
        if not _is_real(loss) or not math.isfinite(loss) or loss <= 0:
            raise errors.InvalidArgumentError(f"loss must be a finite number > 0, got {loss!r}")
        loss = float(loss)
        if self.initial_loss is None:
            self.initial_loss = loss
        self.loss = loss
        return loss

    def virtual_batch_size(self, *, step=None, epoch=None) -> int:
        self._check_step(step, False)
        self._check_epoch(epoch, False)
        if self.loss is None:
            return self.B0
        return max(1, _ceil(self.B0 * self.initial_loss / self.loss))

    def __repr__(self):
        return f"AdaDamp({self.B0}{self._cap_repr()})"
