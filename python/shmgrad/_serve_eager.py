"""``shmgrad serve --eager MODULE:FUNCTION [options]``: an engine with eager workers.

The command line execs this module with serve's arguments. It imports MODULE (the
current directory is on the path), calls FUNCTION(), which returns a dict with ``model``,
``loss``, ``dataset`` (optionally ``collate_fn``, ``forward``, ``loss_reduction``), checks
and pickles that job once, and execs ``shmgrad serve`` again with the job in place of
``--eager``: the process stays the engine's coordinator, so ``shmgrad stop``, signals and
attach by name work as for any engine. A failure before that exec is reported like
serve's own (``--status-fd``'s JSON line, exit status 1).
"""

import argparse
import importlib
import json
import os
import sys

EXIT_FAILURE = 1


def _split_arguments(args):
    """serve's arguments: (the options this module takes or reads, every other argument as
    given). ``--loss`` is dropped (the job's loss is used); ``--status-fd`` stays in both."""
    parser = argparse.ArgumentParser(prog="shmgrad serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--eager")
    parser.add_argument("--model")
    parser.add_argument("--loss")
    parser.add_argument("--status-fd")
    ours, rest = parser.parse_known_args(args)
    if ours.status_fd is not None:
        rest += ["--status-fd", ours.status_fd]
    return ours, rest


def load_job_function(spec: str) -> dict:
    from . import errors
    from ._job import SERVE_JOB_KEYS as JOB_KEYS

    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise errors.InvalidArgumentError(
            f"--eager {spec!r}: give MODULE:FUNCTION, e.g. --eager my_training:job"
        )
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise errors.InvalidArgumentError(
            f"--eager {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
            "run serve from the directory that holds it, or put it on PYTHONPATH"
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise errors.InvalidArgumentError(
            f"--eager {spec!r}: {module_name} has no function {func_name!r}"
        )
    job = func()
    if not isinstance(job, dict) or "model" not in job or "loss" not in job:
        raise errors.InvalidArgumentError(
            f"--eager {spec!r}: {func_name}() must return a dict with 'model', 'loss' and "
            f"optionally {', '.join(JOB_KEYS[2:])}; got {type(job).__name__}"
        )
    unknown = set(job) - set(JOB_KEYS)
    if unknown:
        raise errors.InvalidArgumentError(
            f"--eager {spec!r}: unknown keys {sorted(unknown)} in the job: use "
            f"{', '.join(JOB_KEYS)}"
        )
    return job


def main(argv) -> int:
    try:
        ours, args = _split_arguments(list(argv[1:]))
    except SystemExit:  # argparse has printed what is wrong
        return EXIT_FAILURE
    spec, status_fd = ours.eager, ours.status_fd
    try:
        from . import _job
        from . import errors
        from ._native import _C
        from ._launcher import installed_binary

        if spec is None:
            raise errors.InvalidArgumentError("--eager MODULE:FUNCTION is required here")
        if ours.model is not None:
            raise errors.InvalidArgumentError("give --eager or --model, not both")
        job = load_job_function(spec)
        prepared = _job.prepare_job(
            **{**dict.fromkeys(_job.SERVE_JOB_KEYS), **job}, loss_names=_C.loss_names()
        )
        serve = [
            installed_binary("shmgrad", "SHMGRAD_BINARY"),
            "serve",
            *args,
            "--model",
            prepared.holder_path,
            "--loss",
            _C.loss_names()[0],
            *prepared.serve_arguments(),
        ]
    except Exception as exc:
        kind = getattr(exc, "kind", None) or _kind_of(exc)
        if status_fd is not None:
            try:
                os.write(
                    int(status_fd),
                    (
                        json.dumps(
                            {
                                "event": "failed",
                                "pid": os.getpid(),
                                "kind": kind,
                                "message": str(exc),
                            }
                        )
                        + "\n"
                    ).encode(),
                )
            except (OSError, ValueError):
                pass
        print(f"shmgrad serve: error ({kind}): {exc}", file=sys.stderr)
        return EXIT_FAILURE
    os.execv(serve[0], serve)
    return EXIT_FAILURE  # not reached


def _kind_of(exc) -> str:
    from . import errors

    for kind, cls in errors._BY_KIND.items():
        if type(exc) is cls:
            return kind
    return "InvalidArgument" if isinstance(exc, errors.Error) else "System"


if __name__ == "__main__":
    sys.exit(main(sys.argv))
