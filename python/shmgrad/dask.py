"""shmgrad engines on a Dask cluster: :func:`run` calls a function once per Dask worker (or
once per host) with ``torch.distributed`` initialised (gloo), so that each call can start
its node's engine with ``process_group=torch.distributed.group.WORLD``.

Dask only places and starts the calls; the gradients never pass through it. Importing
this module does not import Dask: :func:`run` does, when it is called.
"""

import ipaddress
import os
import socket
import time
import uuid
from typing import Callable, List

from . import multinode as nodes
from . import errors

POLL_S = 0.2  # how often run() looks at its tasks and the cluster's workers
ABANDON_MARGIN_S = 30.0  # after a rank failed, the others get the group's timeout + this
SETUP_TIMEOUT_S = 60.0  # the small set-up calls (worker pids, the free port)
RANK_KEY_PREFIX = "shmgrad-rank"


def run(
    client,
    fn: Callable,
    *args,
    per_host: bool = False,
    timeout: float = nodes.DEFAULT_TIMEOUT_S,
    **kwargs,
) -> List:
    """Runs ``fn(*args, **kwargs)`` once per Dask worker of ``client``'s cluster (once per
    host with ``per_host=True``: on the first worker of each host, by address), each call
    with ``torch.distributed`` initialised: backend gloo, rank = the worker's place in
    address order, rendezvous at the first worker's host on a free port, ``timeout``
    seconds for every collective. The group is destroyed when ``fn`` returns or raises.

    ``fn`` typically starts its node's engine with
    ``shmgrad.Engine(..., process_group=torch.distributed.group.WORLD)`` and trains; it
    must be importable or picklable on the workers (Dask ships it with cloudpickle), and
    every call must reach the same collective calls (construction, ``bind``, each
    ``gradient``) in the same order. Returns the results in rank order.

    Each call runs in one of its worker's task threads, so the worker needs a free
    thread, and workers must be separate processes (``processes=True``: the default
    process group is one per process). If a call raises, the others, blocked in a
    collective, raise NodeError within ``timeout``; run() then raises the first error
    that is not such a consequence (the failing rank's own), naming its rank. If a
    worker dies, its call is abandoned ``timeout`` seconds (plus a margin) later.
    """
    import distributed  # Dask's: loaded only by those who run on a cluster

    if not isinstance(client, distributed.Client):
        raise errors.InvalidArgumentError(
            f"run needs a distributed.Client, got {type(client).__name__}"
        )
    if not callable(fn):
        raise errors.InvalidArgumentError(f"run needs a callable, got {type(fn).__name__}")
    if not timeout > 0:
        raise errors.InvalidArgumentError(f"timeout must be positive seconds, got {timeout!r}")
    workers = _pick_workers(client.scheduler_info()["workers"], per_host)
    _check_separate_processes(client, workers)
    world = len(workers)
    master = workers[0][1]
    loopback = all(_is_loopback(host) for _, host in workers)
    port = client.submit(
        _free_port, master, workers=[workers[0][0]], allow_other_workers=False, pure=False
    ).result(timeout=SETUP_TIMEOUT_S)
    tag = uuid.uuid4().hex[:12]
    futures = [
        client.submit(
            _rank_main,
            fn,
            rank,
            world,
            master,
            port,
            timeout,
            loopback,
            args,
            kwargs,
            workers=[address],
            allow_other_workers=False,
            pure=False,
            key=f"{RANK_KEY_PREFIX}-{tag}-{rank}",
        )
        for rank, (address, _) in enumerate(workers)
    ]
    try:
        _wait(client, futures, [a for a, _ in workers], timeout + ABANDON_MARGIN_S)
    except BaseException:
        client.cancel(futures)
        raise
    failures = []
    for rank, f in enumerate(futures):
        if f.status == "error":
            failures.append((rank, f.exception(), f.traceback()))
        elif f.status != "finished":
            failures.append(
                (
                    rank,
                    errors.NodeError(
                        f"shmgrad.dask.run: rank {rank} (worker {workers[rank][0]}) "
                        "never finished: "
                        "its worker left the cluster",
                        rank=rank,
                    ),
                    None,
                )
            )
    if failures:
        client.cancel(futures)
        rank, exc, tb = _root_cause(failures)
        if hasattr(exc, "add_note"):
            exc.add_note(
                f"(raised by shmgrad.dask.run's rank {rank} of {world}, on worker "
                f"{workers[rank][0]})"
            )
        raise exc.with_traceback(tb)
    return client.gather(futures)


def _pick_workers(info, per_host):
    """[(address, host)] in rank order: every worker, or the first of each host."""
    if not info:
        raise errors.InvalidArgumentError("shmgrad.dask.run: the Dask cluster has no workers")
    workers = sorted((address, w.get("host") or _host_of(address)) for address, w in info.items())
    if per_host:
        seen, first = set(), []
        for address, host in workers:
            if host not in seen:
                seen.add(host)
                first.append((address, host))
        workers = first
    return workers


def _check_separate_processes(client, workers):
    pids = client.run(os.getpid, workers=[a for a, _ in workers])
    by_process = {}
    for address, host in workers:
        by_process.setdefault((host, pids[address]), []).append(address)
    shared = [a for a in by_process.values() if len(a) > 1]
    if shared:
        raise errors.InvalidArgumentError(
            f"shmgrad.dask.run: workers {shared[0]} are one process, and torch.distributed has "
            "one default group per process: start the cluster with processes=True (or use "
            "per_host=True)"
        )


def _wait(client, futures, addresses, grace):
    """Until every task is done; once one failed or a worker left, the others get ``grace``
    seconds (the group's timeout and a margin) before they are abandoned."""
    give_up = None
    while not all(f.done() for f in futures):
        if give_up is None:
            alive = client.scheduler_info()["workers"]
            if any(f.status == "error" for f in futures) or any(a not in alive for a in addresses):
                give_up = time.monotonic() + grace
        elif time.monotonic() > give_up:
            return
        time.sleep(POLL_S)


def _root_cause(failures):
    """The failure that caused the others: the first that is not a NodeError (a rank's own
    error; its peers then fail in the collective), else the first."""
    for failure in failures:
        if not isinstance(failure[1], errors.NodeError):
            return failure
    return failures[0]


# -- on the workers ---------------------------------------------------------------------
def _rank_main(fn, rank, world, master, port, timeout, loopback, args, kwargs):
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        raise errors.InvalidArgumentError(
            f"rank {rank}: torch.distributed is already initialised in this Dask worker "
            "(another shmgrad.dask.run, or a task of its own, is running here)"
        )
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this machine
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{_url_host(master)}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        return fn(*args, **kwargs)
    finally:
        dist.destroy_process_group()


def _free_port(host):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _host_of(address):
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0].strip("[]")


def _is_loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url_host(host):
    return f"[{host}]" if ":" in host else host
