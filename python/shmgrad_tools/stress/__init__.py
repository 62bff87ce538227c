"""``shmgrad stress``: a node-local stress test of an engine under faults, beside the
library (``import shmgrad`` does not load it). Run ``python3 -m shmgrad_tools.stress`` (the
command ``shmgrad stress``); ``run`` holds the run itself, ``workloads`` what each kind of
worker computes (TorchScript and eager), ``__main__`` the command line."""
