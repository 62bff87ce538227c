"""gradient()'s reduction when none is given: the loss's own, so that the gradient is the
one ``loss.backward()`` would give: "mean" for a mean loss (or one that returns
``(loss_sum, count)``), "sum" for a sum."""

import torch

from . import errors, _losses

REDUCTIONS = _losses.REDUCTIONS

# The fix named wherever gradient() cannot find out its default reduction.
SAY_REDUCTION = (
    "give gradient(..., reduction='sum' or 'mean'), or start the engine with loss_reduction= "
    "(for shmgrad serve --eager: the job's 'loss_reduction')"
)


class DefaultReduction:
    """What one client knows of its engine's loss. An :class:`shmgrad.Engine` knows it
    from the job it started (``known``), or holds the job to find it out on the first
    explicit batch (``probe_job``: model, loss, forward); an attached client reads what
    the engine's segment says: known at start, or found out by the workers' first step."""

    def __init__(self, name, trainer):
        self._name = name
        self._trainer = trainer
        self.known = None  # "sum", "mean", "weighted"; None: not known here
        self.probe_job = None

    def is_mean(self, reduction, inputs, targets, batch) -> bool:
        """Whether the step takes the mean: ``reduction`` as given, else the loss's own."""
        if reduction is None:
            reduction = self._default(inputs, targets, batch)
        elif reduction not in REDUCTIONS:
            raise errors.InvalidArgumentError(
                f"unknown reduction {reduction!r}: use 'sum' or 'mean'"
            )
        return reduction == "mean"

    def _default(self, inputs, targets, batch) -> str:
        """Where the workers are to find the loss out (an undeclared callable, no Dataset),
        this trainer probes it first, once, on the batch's first examples as the workers
        would (indices into a dataset spec's examples, which it cannot read, an empty batch,
        or a batch the probe fails on are refused naming the fix)."""
        known = self.known
        if known is None:
            published = self._trainer.loss_reduction()
            if published != "unknown":
                known = self.known = published
        if known is None and self.probe_job is None:
            raise errors.InvalidArgumentError(
                f"engine {self._name!r} cannot tell yet whether its loss is the batch's sum or "
                "its mean (its eager workers find out at their first step, and this trainer "
                f"attached without the job): {SAY_REDUCTION}"
            )
        if known is None:
            probe = None
            if batch is not None:
                probe = batch
            elif inputs is not None and targets is not None:
                probe = (torch.as_tensor(inputs), torch.as_tensor(targets))
            if probe is None:
                raise errors.InvalidArgumentError(
                    "the engine cannot tell yet whether the loss is the batch's sum or its "
                    "mean (its examples are in the engine's dataset, out of this process's "
                    f"reach): {SAY_REDUCTION}"
                )
            known = self.known = self._probe(probe)
        return "sum" if known == "sum" else "mean"

    def _probe(self, batch):
        model, loss, forward = self.probe_job
        if not _losses.batch_length(batch):
            # An empty share (across nodes): it cannot tell, and guessing could make this
            # node sum while the others take the mean.
            raise errors.InvalidArgumentError(
                f"an empty batch cannot tell whether the loss is the batch's sum or its mean: "
                f"{SAY_REDUCTION}"
            )
        batch = _losses.examples(batch, 0, _losses.PROBE_EXAMPLES)
        param = next(model.parameters(), None)
        if param is not None and param.device.type != "cpu":  # a GPU engine's bound module
            batch = _losses.map_tensors(batch, lambda t: t.to(param.device))
        try:
            return _losses.probe_reduction(model, loss, forward, batch)
        except errors.Error:
            raise
        except Exception as exc:  # not a guess, and not the probe again at every step
            raise errors.InvalidArgumentError(
                f"finding out whether the loss is the batch's sum or its mean failed in the "
                f"trainer ({type(exc).__name__}: {exc}): {SAY_REDUCTION}"
            ) from exc
