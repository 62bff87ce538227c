"""Eager workers' losses: the named ones, checking a loss or ``forward`` at start, and
finding out whether a loss returns the batch's sum, its mean over examples, or a
``(loss_sum, count)`` (probing it on a batch's first examples)."""

import copy
import functools
import math
from typing import Optional

import torch

from . import errors
from ._seeding import example_batch


# -- losses ------------------------------------------------------------------------
def _named_loss(name):
    """A loss name's function, summed over the batch (ipc/layout.h's kLossFunctions)."""
    from ._native import _C

    fn = getattr(torch.nn.functional, _C.loss_functions()[name])
    return functools.partial(fn, reduction="sum")


REDUCTIONS = ("sum", "mean")  # what a loss returns for a batch, and gradient()'s reduction


def check_loss(loss, loss_names, *, forward=None, loss_reduction=None) -> Optional[str]:
    """Refuses a loss that is neither a sum nor a mean over the batch, naming the fix.
    Returns the loss's reduction when it is known without running it ("sum" or "mean":
    declared with ``loss_reduction=``, a name, or an ``nn`` loss's ``reduction``), None
    when it must be found out on a batch (:func:`probe_reduction`)."""
    if loss_reduction is not None and loss_reduction not in REDUCTIONS:
        raise errors.InvalidArgumentError(
            f"loss_reduction must be 'sum' or 'mean' (what the loss callable or forward "
            f"returns for a batch), got {loss_reduction!r}"
        )
    if loss is None:
        if forward is None:
            raise errors.InvalidArgumentError(
                "give loss= (a name or a callable loss(outputs, targets)), or forward= "
                "(forward(model, batch) -> the batch's loss)"
            )
        return loss_reduction
    if isinstance(loss, str):
        if loss not in loss_names:
            raise errors.InvalidArgumentError(
                f"unknown loss {loss!r}: use one of {', '.join(loss_names)}, or pass a callable "
                "loss(outputs, targets)"
            )
        if forward is None and loss_reduction == "mean":
            raise errors.InvalidArgumentError(
                f"the loss {loss!r} is summed over the batch: drop loss_reduction='mean' (ask "
                "engine.gradient(..., reduction='mean') for the mean)"
            )
        return loss_reduction if forward is not None else "sum"
    if not callable(loss):
        raise errors.InvalidArgumentError(
            f"loss must be a name ({', '.join(loss_names)}) or a callable, got "
            f"{type(loss).__name__}"
        )
    reduction = getattr(loss, "reduction", None)
    if reduction == "batchmean":  # nn.KLDivLoss: the sum over the batch over its examples
        reduction = "mean"
    if forward is None and isinstance(loss, torch.nn.Module) and reduction is not None:
        if reduction not in REDUCTIONS:
            raise errors.InvalidArgumentError(
                f"the loss {type(loss).__name__}(reduction={reduction!r}) does not reduce the "
                f"batch to one number: create it with reduction='mean' (or 'sum')"
            )
        if loss_reduction is not None and loss_reduction != reduction:
            raise errors.InvalidArgumentError(
                f"loss_reduction={loss_reduction!r} contradicts the loss "
                f"{type(loss).__name__}(reduction={reduction!r}): drop loss_reduction="
            )
        return reduction
    return loss_reduction


def _modules_held(fn):
    """The modules a loss or forward callable holds, with where: itself, the object of a
    bound method, a partial's arguments, a function's closure cells and the globals its
    code names (what cloudpickle sends to the workers with it)."""
    if fn is None or isinstance(fn, str):
        return
    if isinstance(fn, torch.nn.Module):
        yield type(fn).__name__, fn
        return
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        yield type(owner).__name__, owner
    if isinstance(fn, functools.partial):
        for value in (fn.func, *fn.args, *fn.keywords.values()):
            if isinstance(value, torch.nn.Module):
                yield type(value).__name__, value
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        if isinstance(value, torch.nn.Module):
            yield name, value
    fn_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        value = fn_globals.get(name)
        if isinstance(value, torch.nn.Module):
            yield name, value


def check_no_parameters_outside(model, *, loss, forward) -> None:
    """Refuses a loss or forward that holds trainable parameters the model does not have
    (a loss module with a learned weight, a head kept beside the model): the engine shares
    and reduces the model's parameters only, so they would get no gradient in the trainer
    and would silently never train. The model's own parameters, referred to from a loss
    (a penalty on the weights), are the workers' shared ones: they are fine."""
    own = {id(p) for p in model.parameters()}
    for role, fn in (("loss", loss), ("forward", forward)):
        for where, module in _modules_held(fn):
            stray = [
                n for n, p in module.named_parameters() if p.requires_grad and id(p) not in own
            ]
            if stray:
                raise errors.InvalidArgumentError(
                    f"the {role} holds {where}, whose trainable parameters are not the "
                    f"model's ({', '.join(stray[:4])}{', ...' if len(stray) > 4 else ''}): "
                    "the engine shares and reduces the model's parameters only, so these "
                    "would get no gradient in the trainer and never train. Make them part of "
                    "the model (a module holding the model and them, with forward=lambda "
                    "model, batch: ...), or freeze them with requires_grad_(False)"
                )


# How far the loss of a batch given twice may be from twice (a sum) or once (a mean) its
# loss, relative: float32 sums over a duplicated batch round differently.
PROBE_TOLERANCE = 1e-3


def map_tensors(batch, fn):
    """The batch's structure rebuilt (new dicts and lists: a forward that pops from its
    batch cannot change the caller's) with fn applied to every tensor."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):  # a Mapping (BatchEncoding)
        return {k: map_tensors(batch[k], fn) for k in batch.keys()}
    return batch


def _duplicated(batch):
    """The batch twice over, along the first dimension of every tensor in it."""
    return map_tensors(batch, lambda t: torch.cat([t, t]) if t.dim() > 0 else t)


def call_loss(model, loss, forward, batch):
    """What the loss of ``batch`` is for the job: ``forward(model, batch)``, or
    ``loss(model(batch[0]), batch[1])``."""
    if forward is not None:
        return forward(model, batch)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"the batch is a {type(batch).__name__}, but the default loss call is "
            "loss(model(batch[0]), batch[1]): start the engine with forward=lambda model, "
            "batch: ... (e.g. model(**batch).loss)"
        )
    return loss(model(batch[0]), batch[1])


# How many of the probe batch's first examples the check of a mean loses one by one, and
# how far their mean may be from the loss of them together, relative. Tight: with a fresh
# model every example's loss is close to the same value, so a mean over tokens differs
# from the mean over examples by little (5e-4 for a GPT-2 at initialisation), while the
# same examples in one batch or one by one differ by float32 rounding only.
PROBE_EXAMPLES = 4
MEAN_TOLERANCE = 1e-5


def batch_length(batch) -> Optional[int]:
    """The number of examples in the batch: the first dimension of its first tensor."""
    found = []

    def note(t):
        if t.dim() > 0 and not found:
            found.append(t.shape[0])
        return t

    map_tensors(batch, note)
    return found[0] if found else None


def examples(batch, start, stop):
    """Examples start..stop of the batch, along the first dimension of every tensor."""
    return map_tensors(batch, lambda t: t[start:stop] if t.dim() > 0 else t)


def _loss_value(out) -> float:
    return float(out[0]) / float(out[1]) if isinstance(out, (tuple, list)) else float(out)


def probe_reduction(model, loss, forward, batch) -> str:
    """Finds out whether the job's loss is the batch's sum or its mean: the loss of the
    batch given twice is twice its loss for a sum and the same for a mean (the model in
    eval mode, no gradient). A mean must be over the examples, since each worker's is
    weighted by its shard's examples: the loss of the first examples must be the mean of
    their losses one by one (a mean over tokens or over the targets a loss does not
    ignore is not, once examples differ in them). Raises InvalidArgumentError, naming the
    fix, for a loss that is neither or cannot be told (a loss of 0)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # Each call gets its own copy of the structure (a forward may pop labels).
            twice_batch = _duplicated(batch)
            once = call_loss(model, loss, forward, map_tensors(batch, lambda t: t))
            if isinstance(once, (tuple, list)):  # (loss_sum, count): a sum with its own count
                _check_sum_and_count(once, call_loss(model, loss, forward, twice_batch))
                return "weighted"
            if not isinstance(once, torch.Tensor) or once.numel() != 1:
                raise errors.InvalidArgumentError(
                    "the loss must be one number for the batch, its sum or its mean; got "
                    + (
                        f"a tensor of shape {tuple(once.shape)}"
                        if isinstance(once, torch.Tensor)
                        else type(once).__name__
                    )
                )
            twice = call_loss(model, loss, forward, twice_batch)
            a, b = float(once), float(twice)
            if a != 0 and abs(b - 2 * a) <= PROBE_TOLERANCE * abs(2 * a):
                return "sum"
            if a != 0 and abs(b - a) <= PROBE_TOLERANCE * abs(a):
                _check_mean_over_examples(model, loss, forward, batch)
                return "mean"
    finally:
        model.train(was_training)
    raise errors.InvalidArgumentError(
        f"cannot tell whether the loss is the batch's sum or its mean (loss {a:.6g}, and "
        f"{b:.6g} for the batch given twice, neither the same nor twice as much). If it "
        "is a sum or a mean of per-example terms, say which with Engine(..., "
        "loss_reduction='sum' or 'mean'), or return (loss_sum, count) from forward=. A "
        "loss that couples the batch's examples (in-batch negatives, as in a contrastive "
        "loss) differs when the batch is split: declared, each worker's gradient would "
        "see only its own shard's examples, as each DDP rank does without gathering"
    )


def _check_sum_and_count(once, twice) -> None:
    """Refuses a forward that returns (mean, count) for (loss_sum, count): given twice, the
    batch's count doubles and so must its sum; a mean stays. Anything less clear (a loss
    that mixes the batch's examples) is not refused on a guess."""
    try:
        (s1, c1), (s2, c2) = [(float(s), float(c)) for s, c in (once, twice)]
    except (TypeError, ValueError):
        return  # not two numbers: the worker's own check names what is wrong
    doubled = c1 > 0 and abs(c2 - 2 * c1) <= PROBE_TOLERANCE * 2 * c1
    if doubled and s1 != 0 and abs(s2 - s1) <= PROBE_TOLERANCE * abs(s1):
        raise errors.InvalidArgumentError(
            f"forward returned (loss, count) = ({s1:.6g}, {c1:g}), and ({s2:.6g}, {c2:g}) "
            "for the batch given twice: the count doubles but the loss stays, so it is a "
            "mean. Return the loss summed over what the count counts (e.g. "
            "F.cross_entropy(..., reduction='sum')), and the engine divides by the whole "
            "batch's count"
        )


def _check_mean_over_examples(model, loss, forward, batch) -> None:
    """Refuses a mean loss that is not the mean of its examples' losses (see
    probe_reduction). Not checked where the examples cannot be run one by one (a model
    that needs batch statistics in eval mode): nothing is refused on a guess."""
    n = batch_length(batch)
    if n is None or n < 2:
        return
    k = min(n, PROBE_EXAMPLES)
    try:
        whole = _loss_value(call_loss(model, loss, forward, examples(batch, 0, k)))
        each = [
            _loss_value(call_loss(model, loss, forward, examples(batch, i, i + 1)))
            for i in range(k)
        ]
    except Exception:
        return
    mean = sum(each) / k
    if math.isfinite(whole) and abs(mean - whole) <= MEAN_TOLERANCE * max(abs(whole), 1e-6):
        return
    raise errors.InvalidArgumentError(
        f"the loss is a mean, but not over the batch's examples: {whole:.6g} for the first "
        f"{k} examples, whose losses one by one average {mean:.6g} "
        f"({', '.join(f'{v:.4g}' for v in each)}). A mean over tokens, over the targets a "
        "loss does not ignore (cross_entropy's ignore_index=-100, padding) or with class "
        "weights would be wrong once the batch is split between workers. Return "
        "(loss_sum, count) from forward= (e.g. F.cross_entropy(..., reduction='sum') and "
        "(labels != -100).sum()), or pass the loss module, e.g. loss=nn.CrossEntropyLoss(), "
        "whose denominator the engine computes. If it is a mean over examples and the model "
        "mixes examples even in eval mode, say so with loss_reduction='mean'"
    )


def check_dataset(dataset, *, model, loss, forward, collate_fn, loss_reduction, seed: int = 0):
    """Checks a torch Dataset once, in the trainer, before any worker starts: builds the
    batch of its first PROBE_EXAMPLES examples as a worker would and, with the default
    loss call, that it is an (inputs, targets) pair. Returns the loss's reduction, found
    out on that batch when ``loss_reduction`` is None (:func:`probe_reduction`)."""
    size = len(dataset)
    try:
        batch = example_batch(dataset, range(min(PROBE_EXAMPLES, size)), seed, collate_fn)
    except Exception as exc:
        raise errors.InvalidArgumentError(
            f"building a batch of the dataset's first examples failed ({type(exc).__name__}: "
            f"{exc}): every dataset[i] must work in the trainer too"
            + (
                ""
                if collate_fn is not None
                else ", and collate with default_collate (or give collate_fn=)"
            )
        ) from exc
    if forward is None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise errors.InvalidArgumentError(
            f"the dataset's examples make a batch of type {type(batch).__name__}"
            + (f" (keys {list(batch)[:6]})" if isinstance(batch, dict) else "")
            + ", but the default loss call is loss(model(batch[0]), batch[1]): give "
            "forward=lambda model, batch: ... (e.g. model(**batch).loss), or a collate_fn= "
            "that returns (inputs, targets)"
        )
    if loss_reduction is not None:
        return loss_reduction
    probe = copy.deepcopy(model)
    try:
        return probe_reduction(probe, resolve_loss(loss), forward, batch)
    except errors.Error:
        raise
    except Exception as exc:
        raise errors.InvalidArgumentError(
            f"the loss of the dataset's first examples failed in the trainer "
            f"({type(exc).__name__}: {exc}): check that "
            + (
                "forward(model, batch)"
                if forward is not None
                else "loss(model(batch[0]), batch[1])"
            )
            + " works on a batch that collate_fn builds"
        ) from exc


class CountedClassLoss:
    """A mean cross entropy or NLL loss as the engine runs it: ``(loss_sum, count)``.

    ``nn.CrossEntropyLoss()`` and ``nn.NLLLoss()`` with ``reduction="mean"`` (and
    ``F.cross_entropy`` / ``F.nll_loss`` themselves) divide by the weight of the targets
    they do not ignore: their number with ``ignore_index`` (-100 by default, the padding
    of token labels), the sum of ``weight[target]`` with class weights. A shard's mean
    weighted by its examples would then not be the batch's mean, so the loss is computed
    as a sum with that denominator as its count, which is torch's own mean of the whole
    batch once every shard's sums and counts are added up. Class-probability targets
    (floating point) are averaged over examples as they are: the loss is returned as is.
    """

    def __init__(self, loss):
        self.loss = loss  # the module (a device worker moves it, with its class weights)

    def __call__(self, out, target):
        loss = self.loss
        if not isinstance(target, torch.Tensor) or target.is_floating_point():
            return loss(out, target)
        f = torch.nn.functional
        if isinstance(loss, torch.nn.Module):
            weight, ignore = loss.weight, loss.ignore_index
            smoothing = getattr(loss, "label_smoothing", 0.0)
            cross_entropy = isinstance(loss, torch.nn.CrossEntropyLoss)
        else:
            weight, ignore, smoothing = None, -100, 0.0
            cross_entropy = loss is f.cross_entropy
        kept = target != ignore
        if weight is None:
            count = kept.sum()
        else:  # torch's denominator: the class weights of the targets kept
            count = weight[target.masked_select(kept)].sum()
        if cross_entropy:
            total = f.cross_entropy(
                out, target, weight, ignore_index=ignore, reduction="sum", label_smoothing=smoothing
            )
        else:
            total = f.nll_loss(out, target, weight, ignore_index=ignore, reduction="sum")
        return total, count


def counts_its_mean(loss) -> bool:
    """Whether the loss is a mean cross entropy or NLL loss: see CountedClassLoss."""
    f = torch.nn.functional
    if loss is f.cross_entropy or loss is f.nll_loss:
        return True
    return (
        type(loss) in (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
        and getattr(loss, "reduction", None) == "mean"
    )


def resolve_loss(loss):
    """The callable a worker computes a batch's loss with: a named loss's function, a mean
    cross entropy or NLL loss returning (loss_sum, count) (CountedClassLoss), or the loss
    as given."""
    if isinstance(loss, str):
        return _named_loss(loss)
    return CountedClassLoss(loss) if counts_its_mean(loss) else loss
