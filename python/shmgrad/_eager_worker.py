"""An eager worker process: ``python -m shmgrad._eager_worker NAME SLOT PPID``.

Started and supervised by the coordinator like a TorchScript worker. It loads the job
that the launcher pickled once (model, loss, dataset, collate_fn, forward), makes the
model's parameters views of the shared parameters and their ``.grad`` views of its slot,
then hands the step protocol to the native ``StepParticipant`` (the same C++ code as the
TorchScript worker: wait, barriers, in-place reduction of its slice, with the GIL
released), and which also splits each shard into passes. Python runs only the compute:
:meth:`ShardRunner.compute_pass` per pass, and :meth:`ShardRunner.begin` before a shard
whose ``.grad`` binding or train mode differs from the last one's, or that loads shared
buffers (every shard, for a worker on a GPU: it then also calls
:meth:`ShardRunner.unreached` after it). On the host the native side reads which
parameters backward reached from their ``.grad`` version counters, as ``unreached`` does,
and a pass that is ``loss(model(inputs), targets)`` runs in C++ around the model and the
loss (:meth:`ShardRunner._use_plain_pass`).
"""

import os
import signal
import sys
import traceback

TRACEBACK_FRAMES = 8  # frames of a failing shard's traceback sent to the trainer


def describe(exc: BaseException) -> str:
    """The exception's message and its traceback's last frames, as the trainer shows them."""
    frames = traceback.extract_tb(exc.__traceback__)[-TRACEBACK_FRAMES:]
    text = str(exc) or repr(exc)
    if frames:
        text += f"\nTraceback (most recent call last, last {len(frames)} frames in the worker):\n"
        text += "".join(traceback.format_list(frames)).rstrip("\n")
    return text


class ShardRunner:
    """The compute phase of an eager worker."""

    def __init__(self, participant, job):
        import torch
        from . import _losses, _seeding
        from ._modules import shared_buffers
        from ._native import _C

        self._torch = torch
        self._losses, self._seeding = _losses, _seeding
        self._batch_kind = _C.BatchKind
        self.model = job.model
        self.loss = _losses.resolve_loss(job.loss)
        # "sum", "mean", "weighted" (forward returns (loss_sum, count)), or None: found
        # out on this worker's first pass (_losses.probe_reduction).
        self.loss_reduction = job.loss_reduction
        self.dataset = job.dataset
        # A dataset spec string (dataset="fashion-mnist"): tensors over the segment.
        self.segment_data = participant.dataset_views()
        self.forward = job.forward
        collate = job.collate_fn
        if collate is None:
            from torch.utils.data import default_collate

            collate = default_collate
        self.collate = collate
        names = participant.parameter_names()
        named = list(self.model.named_parameters())
        if [n for n, _ in named] != names:
            raise RuntimeError(
                f"the job's model has parameters {[n for n, _ in named][:5]}... but the engine "
                f"has {names[:5]}...: the job file does not match this engine"
            )
        self.params = [p for _, p in named]
        # The buffers the engine shares, by name, while the model is still on the CPU
        # (shared_buffers takes CPU float32/int64 buffers).
        shared_names = [n for n, _ in shared_buffers(self.model)]
        # An engine with devices: this worker's model, batches and gradient slot are on
        # its GPU (its buffers moved there; its parameters become views below).
        self.device = None if participant.device < 0 else torch.device("cuda", participant.device)
        if self.device is not None:
            torch.cuda.set_device(self.device)
            self.model.to(self.device)
            if isinstance(job.loss, torch.nn.Module):  # its class weights, as criterion.cuda()
                job.loss.to(self.device)
        self.slot_grads = participant.slot_views()
        # Views of the reduced buffer, made when first needed: only a worker alone in a
        # step on the trainer's device computes into it (its memory is that device's).
        self.reduced_grads = None
        self._participant = participant
        self.grads = self.slot_grads  # the .grad views of the current shard
        self._versions = []  # their version counters before the shard's backward
        with torch.no_grad():
            for p, view in zip(self.params, participant.parameter_views()):
                p.data = view  # the shared parameters: an optimizer step is seen at once
        self.grads_in_reduced = None
        self._bind_grads(False)
        # Backward's completed gradients start the reduction of their bucket while the
        # rest of backward runs (docs/DESIGN.md, "Buckets"); hooked in C++, no Python call.
        if self.device is None:
            participant.watch_gradients(self.params)
        # Shared buffers (BatchNorm statistics): loaded before each step, published after
        # it by the step's buffers= rule (docs/DESIGN.md). The model's own
        # are views of one block laid out as the segment's buffer region (on this worker's
        # device), so that loading and publishing them is one copy each, on a GPU one
        # transfer instead of one synchronised copy per buffer.
        engine_names = [n for n, _ in participant.buffer_views()]
        if engine_names != shared_names:
            raise RuntimeError(
                f"the job's model has buffers {shared_names[:5]}... but the engine "
                f"has {engine_names[:5]}..."
            )
        self.shared_block = participant.buffer_block()
        self.slot_block = participant.slot_buffer_block()
        self.block = torch.zeros(
            self.shared_block.numel(), dtype=torch.uint8, device=self.device or "cpu"
        )
        # Most models have none: then a step neither loads nor publishes them (two torch
        # calls from Python, 10-20 us of a short step).
        self.has_buffers = self.block.numel() > 0
        own = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, view in zip(shared_names, participant.buffer_views_of(self.block)):
                view.copy_(own[name])
                own[name].data = view
        self.model.train()
        # torch.compile'd in this worker: the compiled module runs the same parameters
        # (their .data and .grad are the shared views set above).
        options = job.compile
        self.run_model = self.model if options is None else torch.compile(self.model, **options)
        # Linear layers compute their gradients straight into the slot (python/shmgrad/
        # _direct.py): on the host, uncompiled, unless SHMGRAD_DIRECT_LINEAR=0.
        from ._native import tunable_value

        direct = tunable_value("SHMGRAD_DIRECT_LINEAR") != "0"
        if self.device is None and options is None and direct:
            from . import _direct

            _direct.install(self.model, self.params, participant)
        self._use_plain_pass()

    def _bind_grads(self, in_reduced: bool):
        if in_reduced == self.grads_in_reduced:
            return
        if in_reduced and self.reduced_grads is None:
            self.reduced_grads = self._participant.reduced_views()
        self.grads = self.reduced_grads if in_reduced else self.slot_grads
        # A defined .grad is accumulated into in place: backward writes shared memory.
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.grads_in_reduced = in_reduced

    def begin(self, shard):
        """Before the shard's passes (on the host, only where the last shard's binding,
        mode or buffers need it: python/worker_binding.cc, PyShardComputer::beginShard);
        None, or (type name, message with traceback)."""
        try:
            self._bind_grads(shard.grads_in_reduced)
            # Autograd adds to a defined .grad in place, bumping its version counter: the
            # parameters whose counter has not moved after the passes were not reached.
            self._versions = [g._version for g in self.grads]
            if self.has_buffers:
                with self._torch.no_grad():
                    self.block.copy_(self.shared_block)
            if self.model.training != shard.train:
                self.model.train(shard.train)
            return None
        except Exception as exc:  # any error of the user's code goes to the trainer
            return (type(exc).__name__, describe(exc))

    def compute_pass(self, shard, start, stop):
        """One pass over the shard's examples [start, stop): (its loss sum, its count), or
        (type name, message with traceback) on an error. The protocol makes the passes."""
        try:
            return self._compute_pass(shard, start, stop)
        except Exception as exc:  # any error of the user's code goes to the trainer
            return (type(exc).__name__, describe(exc))

    def unreached(self):
        """After the shard's passes: the indices of the parameters backward did not reach
        (an unused branch, a frozen parameter), whose .grad stays None in the trainer when
        no participant reached them, as after plain PyTorch's backward."""
        return [i for i, (g, v) in enumerate(zip(self.grads, self._versions)) if g._version == v]

    def publish_buffers(self, to_slot):
        """This worker's buffers into the shared ones, or into its slot's copy (averaged
        over the step's workers by the first)."""
        if not self.has_buffers:
            return
        with self._torch.no_grad():
            (self.slot_block if to_slot else self.shared_block).copy_(self.block)

    def _compute_pass(self, shard, start, stop):
        """Forward and backward of the loss summed over the pass: the loss as it is (a
        sum), times the pass's examples (a mean), or forward's (loss_sum, count). Returns
        (loss sum, count), the count being the pass's weight in a mean."""
        batch = self._batch(shard, start, stop)
        if self.loss_reduction is None:
            self.loss_reduction = self._losses.probe_reduction(
                self.model, self.loss, self.forward, batch
            )
            # For trainers that attach without the job: gradient()'s default from now on.
            self._participant.publish_loss_reduction(self.loss_reduction)
            self._use_plain_pass()
        out = self._losses.call_loss(self.run_model, self.loss, self.forward, batch)
        return self._finish_pass(out, stop - start, shard)

    def _finish_pass(self, out, examples, shard):
        """The pass's loss (``out``, what the loss or forward returned for its ``examples``)
        backpropagated: (loss sum, count)."""
        torch = self._torch
        per_example = 1  # what turns the loss into the pass's sum: its examples for a mean
        if isinstance(out, (tuple, list)):
            if len(out) != 2:
                raise TypeError(
                    f"forward returned {len(out)} values; return the batch's loss (one number) "
                    "or (loss_sum, count)"
                )
            loss, count = out
            count = float(count.detach()) if isinstance(count, torch.Tensor) else float(count)
        else:
            loss, count = out, float(examples)
            if self.loss_reduction == "mean":
                per_example = examples
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "the loss must be one number for the batch; got "
                + (
                    f"a tensor of shape {tuple(loss.shape)}"
                    if isinstance(loss, torch.Tensor)
                    else type(loss).__name__
                )
                + " (reduce it with .sum() or .mean(), and say which with loss_reduction=)"
            )
        scale = per_example * shard.grad_scale
        (loss * scale if scale != 1.0 else loss).backward()
        return (float(loss.detach()) * per_example, count)

    def _finish_from_native(self, out, examples, shard):
        """_finish_pass for the native plain pass (a loss that was not one tensor): (loss
        sum, count), or (type name, message with traceback) on an error."""
        try:
            return self._finish_pass(out, examples, shard)
        except Exception as exc:  # any error of the user's code goes to the trainer
            return (type(exc).__name__, describe(exc))

    def _use_plain_pass(self):
        """Hands the participant the common pass (loss(model(x), y) on a batch of inputs and
        targets, or of the segment's dataset), which it then takes without this Python
        around it (python/worker_binding.cc, PlainPass): on the host, without forward=, once
        the loss's reduction is known. SHMGRAD_PLAIN_PASS=0 keeps every pass here."""
        from ._native import tunable_value

        if (
            self.device is not None
            or self.forward is not None
            or self.loss_reduction not in ("sum", "mean")
            or tunable_value("SHMGRAD_PLAIN_PASS") == "0"
        ):
            return
        self._participant.set_plain_pass(
            model=self.run_model,
            loss=self.loss,
            finish=self._finish_from_native,
            describe=describe,
            mean=self.loss_reduction == "mean",
            data=self.segment_data if self.dataset is None else None,
        )

    def _batch(self, shard, start, stop):
        batch = self._host_batch(shard, start, stop)
        if self.device is None:
            return batch
        # After collate: the step's inputs go to the device (never its gradients).
        return self._losses.map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))

    def _host_batch(self, shard, start, stop):
        # The pass's rows of each of the shard's tensors. One pass over the whole shard (the
        # usual case) takes them as they are: slicing from Python costs a short step 10-25 us.
        whole = start == 0 and stop == shard.end - shard.begin

        def rows(t):
            return t if whole else t[start:stop]

        if shard.kind == self._batch_kind.explicit:
            return (rows(shard.inputs), rows(shard.targets))
        if shard.kind == self._batch_kind.structured:
            from ._batch import unflatten

            return unflatten(shard.structure, [rows(t) for t in shard.leaves])
        if self.dataset is None and self.segment_data is not None:
            idx = rows(shard.indices)
            return (
                self.segment_data[0].index_select(0, idx),
                self.segment_data[1].index_select(0, idx),
            )
        if self.dataset is None:
            raise ValueError(
                "this engine has no dataset: pass inputs= and targets=, or start it with dataset="
            )
        return self._seeding.example_batch(
            self.dataset, rows(shard.indices).tolist(), shard.seed, self.collate
        )


def main(argv) -> int:
    if len(argv) != 4:
        print("shmgrad._eager_worker is started by `shmgrad serve`, not by hand", file=sys.stderr)
        return 2
    name, slot, ppid = argv[1], int(argv[2]), int(argv[3])
    from ._native import _C

    # The process set-up every kind of worker shares (worker/process.h).
    if not _C.die_with_parent(ppid):
        return _C.EXIT_COORDINATOR_GONE
    _C.keep_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C goes to serve, which stops us
    try:
        participant = _C.StepParticipant(name, slot, ppid)
    except Exception as exc:
        print(f"shmgrad eager worker {slot}: cannot map the engine: {exc}", file=sys.stderr)
        return _C.EXIT_STARTUP_FAILED
    try:
        _C.configure_threads(participant.threads_per_worker)
        from . import _numerics
        from ._job import load_job

        _numerics.apply(participant.numerics)  # the trainer's, where it said

        runner = ShardRunner(participant, load_job(participant.job_path))
    except Exception as exc:
        text = f"eager worker start-up failed: {type(exc).__name__}: {describe(exc)}"
        participant.report_startup_failure(text)
        print(f"shmgrad eager worker {slot}: {text}", file=sys.stderr)
        return _C.EXIT_STARTUP_FAILED
    if not participant.become_ready():
        return _C.EXIT_STOPPED  # retired while starting
    return participant.serve(
        runner.begin, runner.compute_pass, runner.publish_buffers, runner.unreached
    )


def exit_now(code: int):
    """Ends the process without the interpreter's teardown (with torch loaded it takes about
    0.4 s, paid by every engine stop and every shrink), as torch's DataLoader workers do
    (multiprocessing's children end in os._exit, skipping atexit handlers): what the worker
    printed is flushed first; the shared memory and files go with the process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to say on it
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv))
