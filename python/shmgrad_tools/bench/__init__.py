"""``shmgrad bench``: the benchmarks, beside the library (``import shmgrad`` does not load
them). Run ``python3 -m shmgrad_tools.bench`` (the command ``shmgrad bench``) or
``python3 -m shmgrad_tools.bench.feed`` or ``python3 -m shmgrad_tools.bench.augment``.

* ``__main__``: the command line and the run over every configuration;
* ``runners``: one runner per system measured (single process, shmgrad with TorchScript
  or eager workers, DDP over gloo or the shmgrad backend, Dask, the reduction alone, the
  collectives); ``ddp`` the code of one DDP rank;
* ``collectives``: ``--collectives``, the shmgrad backend's collectives against gloo's in
  the same processes, and the memory-traffic bound (the code of one rank, the formulas);
* ``timing``: the clock, the step budget and the timing loop they share;
* ``models``: the models and batches, the same in every process;
* ``report``: the targets, the Markdown tables, the plot;
* ``feed``: where a short one-worker step's time goes;
* ``augment``: per-example augmentation in eager workers against the same in the trainer.
"""
