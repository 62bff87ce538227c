"""Training scripts as the DDP tutorials write them: ``torch.multiprocessing.spawn(main)``
with the model class, the loss function, the Dataset class and the ``collate_fn`` defined
in the script itself. In a spawned process the script is the module ``__mp_main__``,
which an eager worker cannot import: its classes and functions must travel by value, as
those of a plain script's ``__main__`` do. And a job that names something the worker
cannot find is refused naming it, not with an error from shmgrad's internals."""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import shmgrad
from conftest import Mlp, ci_runs

SCRIPT_TIMEOUT_S = 240  # spawned ranks, their engines' start-up included
PG_TIMEOUT_S = 30

# Everything the engine's job holds is defined in the script. Each rank (node) starts its
# engine with two eager workers, gives its share of one global batch (uneven across the
# workers and the nodes) and compares the gradient with plain PyTorch's on the whole batch.
SCRIPT = textwrap.dedent(
    """
    import copy, datetime, os, socket, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import shmgrad

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(6, 8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    class Points(torch.utils.data.Dataset):
        def __len__(self):
            return 30

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(6, generator=g), "y": i % 3}

    def collate(examples):
        return torch.stack([e["x"] for e in examples]), torch.tensor([e["y"] for e in examples])

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="sum") + 0.5 * out.pow(2).sum()

    BATCH = [3, 17, 4, 29, 0, 11, 8, 21, 14]

    def main(rank, nodes, port):
        group = None
        if nodes > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=nodes, timeout=datetime.timedelta(seconds=PG_S))
            group = dist.group.WORLD
        torch.manual_seed(0)
        model = Net()
        ref = copy.deepcopy(model)
        ds = Points()
        with shmgrad.Engine(model=model, workers=2, loss=loss_fn, dataset=ds,
                            collate_fn=collate, mode="eager", process_group=group) as engine:
            engine.bind(model)
            stats = engine.gradient(BATCH[rank::nodes], reduction="sum")
            got = [p.grad.clone() for p in model.parameters()]
        x, y = collate([ds[i] for i in BATCH])
        loss_fn(ref(x), y).backward()
        err = max(float((g - p.grad).norm() / p.grad.norm()) for g, p in zip(got, ref.parameters()))
        print(f"rank {rank}: {stats.num_examples} examples, relative error {err:.2e}", flush=True)
        if nodes > 1:
            dist.destroy_process_group()
        assert err < 1e-5, err

    if __name__ == "__main__":
        nodes = int(sys.argv[1])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(main, args=(nodes, port), nprocs=nodes)
        print("all ranks done")
    """
).replace("PG_S", str(PG_TIMEOUT_S))


@pytest.mark.parametrize("nodes", ci_runs([1, 2], keep=("1",)))
def test_spawned_script_defines_the_whole_job(tmp_path, nodes):
    script = tmp_path / "train_spawned.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(nodes)],
        cwd=tmp_path,
        env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(nodes):
        assert f"rank {rank}: " in out, out[-4000:]
    assert "all ranks done" in out, out[-4000:]


def test_a_job_naming_what_the_worker_cannot_import_is_refused_naming_it():
    """A model class of a module that exists only in the trainer's memory (as a module
    built at run time, or one imported from a path the workers lack): the worker's
    start-up error names the class, its module and the fix."""
    ghost = types.ModuleType("shmgrad_ghost_module")

    class Ghost(Mlp):
        pass

    Ghost.__module__ = ghost.__name__
    Ghost.__qualname__ = "Ghost"
    ghost.Ghost = Ghost
    sys.modules[ghost.__name__] = ghost  # cloudpickle then pickles Ghost by reference
    try:
        with pytest.raises(shmgrad.WorkerError) as info:
            shmgrad.Engine(model=Ghost(), workers=1, loss="cross_entropy", mode="eager")
    finally:
        del sys.modules[ghost.__name__]
    text = str(info.value)
    assert "'Ghost' of module 'shmgrad_ghost_module'" in text, text
    assert "cannot import" in text and "register_pickle_by_value" in text, text


def test_the_callers_pickle_registry_is_left_as_it_was():
    import cloudpickle

    from shmgrad import _job

    before = set(cloudpickle.list_registry_pickle_by_value())
    fake_script = types.ModuleType("__mp_main__")
    saved = sys.modules.get("__mp_main__")
    sys.modules["__mp_main__"] = fake_script
    try:
        assert _job._script_modules() == [fake_script]
        _job._dumps(torch.nn.Linear(2, 2), cloudpickle)
    finally:
        if saved is None:
            del sys.modules["__mp_main__"]
        else:
            sys.modules["__mp_main__"] = saved
    assert set(cloudpickle.list_registry_pickle_by_value()) == before
