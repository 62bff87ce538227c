"""Notices a gradient that ``gradient()`` produced and that was discarded before an
optimizer step could use it, and warns once, naming the cause.

The case it is for: ``engine.gradient()`` called inside a LightningModule's
``training_step`` under automatic optimization. Lightning's closure runs ``training_step``,
then ``optimizer.zero_grad()`` (``.grad`` set to None), then ``backward``, then the step:
the step finds no gradient and the model trains on nothing, silently. An optimizer step
post-hook (one per client, global to torch.optim) looks, after a step over the bound
parameters, whether the gradient given since the last such step was still there:

- the watched parameter's ``.grad`` None, or another tensor: set to None or replaced;
- its version changed in place (``zero_grad(set_to_none=False)``, but also clipping or a
  GradScaler's unscaling) and every bound ``.grad`` is now all zeros: zeroed.

The cost, per optimizer step: one attribute test while no gradient awaits a step, else a
few attribute reads (and a cached lookup of whether the optimizer holds bound
parameters); the scan for zeros runs only when the watched gradient is all zeros after
an in-place change.
"""

import warnings
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook

LIGHTNING_DOC = "docs/LIGHTNING.md"


class DiscardWatch:
    def __init__(self, engine_name: str):
        self.engine_name = engine_name
        self.warned = False
        self._params = []  # the bound parameters that get a .grad
        self._param_ids = frozenset()
        self._holds = weakref.WeakKeyDictionary()  # optimizer -> (groups, holds bound?)
        self._watched = None  # (parameter, its .grad as given, that .grad's version)
        self._hook = None

    def bind(self, params):
        """Watches ``params`` (those given a ``.grad``) from now on."""
        self._params = list(params)
        self._param_ids = frozenset(id(p) for p in self._params)
        self._holds = weakref.WeakKeyDictionary()
        self._watched = None
        if self._hook is None:
            this = weakref.ref(self)  # the hook must not keep a closed client alive

            def after_step(optimizer, args, kwargs):
                watch = this()
                if watch is not None:
                    watch.after_step(optimizer)

            self._hook = register_optimizer_step_post_hook(after_step)

    def gradient_given(self, param):
        """``gradient()`` has just set ``param.grad`` (a bound parameter that a backward
        reached): it awaits an optimizer step."""
        if param is not None and not self.warned:
            grad = param.grad
            self._watched = (param, grad, grad._version)

    def after_step(self, optimizer):
        watched = self._watched
        if watched is None or not self._holds_bound(optimizer):
            return
        self._watched = None  # this step had its chance at the gradient
        cause = self._discarded(*watched)
        if cause is not None:
            self.warned = True
            warnings.warn(
                f"engine {self.engine_name!r}: {type(optimizer).__name__}.step() ran on "
                f"gradients that were {cause} after engine.gradient() gave them, so this step "
                "did not use the engine's gradient. Zero or drop .grad before gradient(), "
                "not between it and step(). In a LightningModule (automatic optimization), "
                "Lightning calls optimizer.zero_grad() after training_step: train with "
                "Trainer(strategy='shmgrad') (shmgrad.lightning) and no engine of your own, "
                f"or override optimizer_zero_grad and backward, as {LIGHTNING_DOC} shows",
                RuntimeWarning,
                stacklevel=2,
            )

    def _discarded(self, param, grad, version):
        now = param.grad
        if now is None:
            return "set to None (optimizer.zero_grad())"
        if now.data_ptr() != grad.data_ptr():
            return "replaced by other tensors (a backward after optimizer.zero_grad())"
        if now._version != version and not bool(now.any()):
            if not any(bool(p.grad.any()) for p in self._params if p.grad is not None):
                return "zeroed (optimizer.zero_grad(set_to_none=False))"
        return None

    def _holds_bound(self, optimizer) -> bool:
        groups = optimizer.param_groups
        known = self._holds.get(optimizer)
        if known is None or known[0] != len(groups):
            ids = self._param_ids
            holds = any(id(p) in ids for g in groups for p in g["params"])
            known = (len(groups), holds)
            self._holds[optimizer] = known
        return known[1]

    def close(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._watched = None
