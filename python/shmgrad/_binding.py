"""The module bound to an engine (:meth:`shmgrad.Client.bind`): its parameters are views
of the engine's shared parameters, its ``.grad`` views of the reduced gradient and its
buffers views of the shared buffers, and they stay so across ``optimizer.zero_grad()``,
freezing and unfreezing, parameters that no backward reached, and a GPU engine's copies
of the buffers."""

import operator
import warnings

import torch

from . import errors
from ._discard import DiscardWatch
from ._modules import compiled_original, has_batchnorm, shared_buffers

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NONE_UNUSED = frozenset()


class Binding:
    """One client's bound module, or none yet (then ``params`` is empty).

    ``grad_sets`` are the engine's two reduced gradients (a step writes the first;
    accumulating steps alternate), as the trainer's views; the bound module's ``.grad``
    are other tensor objects over the same memory (``grad_aliases``), so that a
    conversion that replaces a ``.grad``'s data in place (``model.double()``, ``.to()``)
    cannot touch the engine's own views."""

    def __init__(self, name, trainer, param_info, param_views, grad_sets, device):
        self.name = name
        self._trainer = trainer
        self._param_info = param_info
        self._param_views = param_views
        self._grad_sets = grad_sets
        self._device = device  # a GPU engine's: the module's buffers are copies there
        self.module = None
        self.params = []  # the bound module's parameters, in the engine's order
        self.trainable = []  # those of them that require grad: the ones given a .grad
        self._flags = []  # each bound parameter's requires_grad, as last seen
        # Which parameters the workers' models train (requires_grad when the engine
        # started): an Engine knows them from its model; attach() takes the bound module's.
        self.engine_trainable = None
        self.grad_aliases = grad_sets
        self._trainable_grad_sets = grad_sets  # the aliases of the trainable parameters
        self._ptrs = None  # the first and last parameters' addresses: still the engine's?
        # The parameters (indices) no participant's backward reached in the last result
        # (every micro-batch of an accumulation), and those whose .grad was set to None
        # for it: they keep .grad None, as after plain PyTorch's backward.
        self._unused = _NONE_UNUSED
        self._nulled = ()
        self.has_batchnorm = False
        self.mirrors = []  # a GPU engine's (device block, shared block) of the buffers
        self.views_handed_out = False  # gradient_tensors()/parameter_tensors() were asked for
        self._warned_unbound = False
        # Warns once when a gradient was dropped before an optimizer step used it.
        self.discard_watch = DiscardWatch(name)

    @property
    def training(self) -> bool:
        """The bound module's train/eval mode, which goes to the workers with a step."""
        return self.module.training if self.module is not None else True

    def bind(self, module, nodes):
        """:meth:`shmgrad.Client.bind`'s work (see there)."""
        given = module
        module, _ = compiled_original(module)  # a torch.compile'd module: the one it wraps
        named = list(module.named_parameters())
        if len(named) != len(self._param_info):
            raise errors.InvalidArgumentError(
                f"the module has {len(named)} parameters but the engine has "
                f"{len(self._param_info)}: "
                "bind the module the engine was started with"
            )
        for i, ((name, p), (ename, eshape)) in enumerate(zip(named, self._param_info)):
            if name != ename or tuple(p.shape) != eshape or p.dtype != torch.float32:
                raise errors.InvalidArgumentError(
                    f"module parameter {i} {name!r} {tuple(p.shape)} ({p.dtype}) does "
                    "not match the "
                    f"engine's {ename!r} {eshape} (float32): bind the module the engine "
                    "was started with"
                )
        flags = [p.requires_grad for _, p in named]
        if self.engine_trainable is None:
            self.engine_trainable = flags
        self._check_trainable(flags)
        self.grad_aliases = tuple([g.detach() for g in views] for views in self._grad_sets)
        with torch.no_grad():
            for (_, p), view, grad in zip(named, self._param_views, self.grad_aliases[0]):
                view.copy_(p.detach())
                p.data = view
                p.grad = grad
        self._bind_buffers(module)
        self.params = [p for _, p in named]
        self._ptrs = (named[0][1].data_ptr(), named[-1][1].data_ptr()) if named else None
        self._unused, self._nulled = _NONE_UNUSED, ()
        self._set_trainable(flags)
        self.module = module
        self.has_batchnorm = has_batchnorm(module)
        if nodes is not None:
            nodes.broadcast_parameters()  # every node takes rank 0's values
            self.pull_buffers()
        return given

    def check_unchanged(self):
        """Before a step: the bound parameters still lie in the engine's memory, and a
        parameter frozen or unfrozen since the last step (about 0.4 us a parameter to
        look) changes which ones get a .grad."""
        params = self.params
        if not params:
            return
        if (params[0].data_ptr(), params[-1].data_ptr()) != self._ptrs:
            self._refuse_moved_parameters()
        flags = list(map(_REQUIRES_GRAD, params))
        if flags != self._flags:
            self._check_trainable(flags)
            self._set_trainable(flags)

    def _refuse_moved_parameters(self):
        """The bound module's parameters left the engine's memory after bind: an optimizer
        would step private copies that no worker sees (and gradient() would fill .grad
        tensors it no longer steps with). Refused, naming the parameter and the fix."""
        moved, p = next(
            (name, p)
            for (name, _), p, view in zip(self._param_info, self.params, self._param_views)
            if p.data_ptr() != view.data_ptr()
        )
        raise errors.InvalidArgumentError(
            f"the bound module's parameter {moved!r} ({p.dtype}, {p.device}) no longer lies "
            f"in engine {self.name!r}'s memory: its data was replaced after bind "
            "(model.to(), .cuda(), .double(), .half() or an assignment to .data), so the "
            "optimizer would step a copy that no worker sees. Convert the model before "
            "starting the engine and evaluate a converted copy (copy.deepcopy(model).to(...)), "
            "or convert it back and call engine.bind(model) again, which copies its values in"
        )

    def _check_trainable(self, flags):
        """Refuses a parameter that requires grad but that the workers' models have frozen:
        they compute no gradient for it, so it would train on zeros."""
        thawed = [
            name
            for (name, _), now, then in zip(self._param_info, flags, self.engine_trainable)
            if now and not then
        ]
        if thawed:
            raise errors.InvalidArgumentError(
                f"parameter {thawed[0]!r}{f' (and {len(thawed) - 1} more)' if thawed[1:] else ''}"
                " requires grad, but it was frozen (requires_grad=False) in the model the "
                f"engine {self.name!r} started with, so its workers compute no gradient for "
                "it: start the engine with every parameter you will train unfrozen (freezing "
                "one later is fine: its .grad then stays None)"
            )

    def _set_trainable(self, flags):
        """Gives a .grad (a view of the reduced gradient) to the bound parameters that
        require grad, and None to the others, as backward leaves a frozen parameter's: an
        optimizer then skips it (no weight decay, no momentum), as in plain PyTorch."""
        self._flags = flags
        self.trainable = [p for p, f in zip(self.params, flags) if f]
        if all(flags):
            self._trainable_grad_sets = self.grad_aliases
        else:
            self._trainable_grad_sets = tuple(
                [g for g, f in zip(views, flags) if f] for views in self.grad_aliases
            )
        for p, f in zip(self.params, flags):
            if not f:
                p.grad = None
        self.discard_watch.bind(self.trainable)

    def _bind_buffers(self, module):
        # The engine's shared buffers (BatchNorm statistics) by name: the module's values
        # are copied in once, then its buffers view them (on a GPU engine: one block on the
        # device, exchanged with them around each step), so after every step it holds the
        # step's statistics (the buffers= rule's) and evaluates with no extra pass.
        views = dict(self._trainer.buffer_views())
        own = dict(shared_buffers(module))
        if set(views) != set(own):
            raise errors.InvalidArgumentError(
                f"the module's buffers {sorted(own)[:4]}... differ from the engine's "
                f"{sorted(views)[:4]}...: bind the module the engine was started with"
            )
        mirror = None
        if self._device is not None and views:
            # Beside the parameters on the GPU: the module's buffers are views of one block
            # there, laid out as the segment's buffer region, exchanged with it in one copy
            # each way around a step (not one synchronised copy per buffer).
            shared = self._trainer.buffer_block()
            block = torch.zeros(shared.numel(), dtype=torch.uint8, device=self._device)
            on_device = dict(zip(views, self._trainer.buffer_views_of(block)))
            mirror = (block, shared)
        with torch.no_grad():
            for n, b in own.items():
                if tuple(b.shape) != tuple(views[n].shape) or b.dtype != views[n].dtype:
                    raise errors.InvalidArgumentError(
                        f"module buffer {n!r} {tuple(b.shape)} ({b.dtype}) does not match the "
                        f"engine's {tuple(views[n].shape)} ({views[n].dtype})"
                    )
                views[n].copy_(b)
                if mirror is None:
                    b.data = views[n]
                else:
                    on_device[n].copy_(b)
                    b.data = on_device[n]
        self.mirrors = [mirror] if mirror is not None else []

    def push_buffers(self):
        """A GPU engine's bound module's buffers into the shared ones (before a step): one
        copy of their block."""
        with torch.no_grad():
            for own, shared in self.mirrors:
                shared.copy_(own)

    def pull_buffers(self):
        """The shared buffers into a GPU engine's bound module's (after a step): one copy."""
        with torch.no_grad():
            for own, shared in self.mirrors:
                own.copy_(shared)

    def grad_dropped(self) -> bool:
        """Whether ``optimizer.zero_grad(set_to_none=True)`` dropped a .grad that the last
        result gave (an accumulation then starts afresh)."""
        if not self.trainable:
            return False
        nulled = {id(p) for p in self._nulled}  # None for no backward reached them
        return any(p.grad is None for p in self.trainable if id(p) not in nulled)

    def after_step(self, current, unused, accumulated):
        """After a step whose result is in reduced gradient ``current``: the .grad of the
        bound parameters point at it, and those of ``unused`` (no participant's backward
        reached them; in an accumulation, in no micro-batch) are None."""
        if accumulated:
            unused = [i for i in unused if i in self._unused]
        self._unused = frozenset(unused) if unused else _NONE_UNUSED
        if self.params:
            self._relink_grads(current)
            self.discard_watch.gradient_given(self._first_given())
        elif not self.views_handed_out and not self._warned_unbound:
            self._warned_unbound = True
            warnings.warn(
                f"engine {self.name!r}: gradient() filled the engine's reduced gradient, but no "
                "module is bound, so no .grad changed and an optimizer would not move: call "
                "engine.bind(model) once before training (or read engine.gradient_tensors())",
                stacklevel=3,
            )

    def _relink_grads(self, current):
        # optimizer.zero_grad(set_to_none=True) (the default in newer PyTorch) drops every
        # .grad at once; point them at the reduced gradient again. Looking at the first and
        # the last is enough to see that, and keeps the step's Python cost flat in the
        # number of parameters. Identity, not data_ptr(): a .grad that is still our view
        # is the same tensor object (bind assigned it), and the check stays two reads.
        bound = self.trainable
        if not bound:
            return
        views = self._trainable_grad_sets[current]
        if self._nulled or bound[0].grad is not views[0] or bound[-1].grad is not views[-1]:
            for p, g in zip(bound, views):
                if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                    p.grad = g
            self._nulled = ()
        if self._unused:
            # No participant's backward reached these (an unused branch): their .grad is
            # None, as after plain PyTorch's backward, so an optimizer skips them (no weight
            # decay, no momentum) instead of stepping a zero gradient.
            flags, params = self._flags, self.params
            self._nulled = tuple(params[i] for i in self._unused if flags[i])
            for p in self._nulled:
                p.grad = None

    def _first_given(self):
        """The first bound parameter that the last result gave a .grad (None if none)."""
        if not self._nulled:
            return self.trainable[0] if self.trainable else None
        nulled = {id(p) for p in self._nulled}
        return next((p for p in self.trainable if id(p) not in nulled), None)

    def keep_copies(self):
        """Before a GPU engine's memory goes: the bound module keeps copies of its
        parameters and gradients (made, and waited for, before anything is dropped), and
        this binding lets go of every view of the engine's memory."""
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.clone()
                if p.grad is not None:
                    p.grad = p.grad.clone()
        if self._device is not None:
            torch.cuda.synchronize(self._device)  # the copies have read the engine's memory
        self._param_views = []
        self._grad_sets = self.grad_aliases = self._trainable_grad_sets = ([], [])
