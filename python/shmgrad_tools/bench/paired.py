"""``shmgrad bench --paired`` (one machine): DDP's ranks and shmgrad's engines in the same
run of processes, every batch through each system in turn (the order reversed on every
other batch, ``ddp.alternating_steps``), so that each pair of steps sees the same moments
of a noisy machine. Rank 0 of the DDP group is also the trainer of a shmgrad engine of N
workers (TorchScript, and eager workers with ``eager``); with ``ddp-shmgrad`` the same
ranks also run a second DDP model over a ``shmgrad`` group of the same ranks
(``dist.new_group(backend="shmgrad")``; the default group stays gloo's). While one system
steps, the other system's processes sleep (DDP's ranks in gloo's barrier, the engine's
workers on their futex: an engine of N >= 2 workers on a machine with no spare core does
not spin).

Kept apart from the runners so that a spawned rank imports only this, DDP's side, the
models and the clock, not Dask or the report."""

import contextlib
import traceback

import torch.distributed as dist

from . import models
from .ddp import alternating_steps, ddp_step, join_local_group

# The engine systems a paired run may hold, and their worker mode.
ENGINE_MODES = {"shmgrad": "script", "eager": "eager"}
# The DDP system a paired run may hold beside DDP over gloo: DDP over the shmgrad backend.
DDP_SHMGRAD = "ddp-shmgrad"


@contextlib.contextmanager
def engine_step(
    rank, world, model_name, batch, x0, warmup, seed, engine_name, mode, timeout_s, out
):
    """On rank 0: an engine of ``world`` workers for the ``with`` block and its step on the
    whole batch, ``step(i, x, y)``, timed in this process around ``engine.gradient`` as
    ``shmgrad bench`` times it unpaired; into ``out`` go each timed step's slowest worker's
    forward and backward (``compute``) and batch 0's gradient (``grad``). On the other
    ranks: a step that does nothing (they wait at the next barrier)."""
    out.update({"compute": [], "grad": None})
    if rank != 0:
        yield lambda i, x, y: None
        return
    with models.engine(
        models.make_model(model_name, seed),
        world,
        engine_name,
        batch,
        x0,
        min(120.0, timeout_s),
        mode=mode,
    ) as engine:
        grads = engine.gradient_tensors()  # read directly: no module is bound

        def step(i, x, y):
            st = engine.gradient(inputs=x, targets=y, reduction="sum", timeout=timeout_s)
            if st.workers != world:
                raise RuntimeError(f"the step ran on {st.workers} workers, not {world}")
            if i == 0:
                out["grad"] = models.flat(grads).numpy()
            if i >= warmup:
                out["compute"].append(max(st.compute_seconds))

        yield step


def rank_main(
    rank,
    world,
    port,
    model_name,
    batch,
    warmup,
    repeats,
    seed,
    engine_prefix,
    systems,
    queue,
    timeout_s,
):
    """Runs ``warmup + repeats`` batches through DDP and each system in ``systems`` (the
    engine systems, and ``ddp-shmgrad``) in turn and puts ``(rank, {system: {"start",
    "end", "grad", ...}})`` on ``queue`` (or an error)."""
    try:
        join_local_group(rank, world, port, timeout_s, False)  # 1 thread, like a worker
        try:
            batches = models.make_batches(model_name, batch, warmup + repeats, seed)
            outs = {"ddp": {}}
            steps = {"ddp": ddp_step(rank, world, model_name, batch, seed, outs["ddp"])}
            if DDP_SHMGRAD in systems:
                import shmgrad  # noqa: F401  (registers the backend)

                group = dist.new_group(backend="shmgrad")
                outs[DDP_SHMGRAD] = {}
                steps[DDP_SHMGRAD] = ddp_step(
                    rank, world, model_name, batch, seed, outs[DDP_SHMGRAD], group
                )
            with contextlib.ExitStack() as stack:
                for system in (s for s in systems if s in ENGINE_MODES):
                    outs[system] = {}
                    steps[system] = stack.enter_context(
                        engine_step(
                            rank,
                            world,
                            model_name,
                            batch,
                            batches[0][0],
                            warmup,
                            seed,
                            f"{engine_prefix}-{system}",
                            ENGINE_MODES[system],
                            timeout_s,
                            outs[system],
                        )
                    )
                times = alternating_steps(batches, warmup, steps)
            for name, out in outs.items():
                out.update(times[name])
            queue.put((rank, outs))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))
