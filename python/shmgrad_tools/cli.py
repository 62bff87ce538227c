"""The ``shmgrad`` command of an installed package (``pip install``'s console script):
runs the native program that ships in the shmgrad package's ``bin/``, telling it which
Python runs ``shmgrad stress``, ``shmgrad bench`` and ``serve --eager``: this one, whose
environment has torch and shmgrad.

It finds the program without importing shmgrad, which loads torch (a second or more):
``shmgrad status``, ``stop`` and ``--help`` answer at once. Only when the program is
missing does it import shmgrad, whose :func:`shmgrad.program` says what is wrong."""

import importlib.util
import os
import sys

PYTHON_ENV = "SHMGRAD_PYTHON"  # read by the native program (tools/shmgrad_main.cc)
BINARY_ENV = "SHMGRAD_BINARY"  # the program's path, if set (ipc/config.h's kTunables)


def program_path() -> str:
    """Where the program should be: ``$SHMGRAD_BINARY`` if set, else ``bin/shmgrad`` in
    the installed shmgrad package (found without running its ``__init__``), the rule of
    :func:`shmgrad.program`."""
    env = os.environ.get(BINARY_ENV)
    if env:
        return env
    spec = importlib.util.find_spec("shmgrad")
    if spec is None or not spec.submodule_search_locations:
        return ""
    return os.path.join(list(spec.submodule_search_locations)[0], "bin", "shmgrad")


def main():
    program = program_path()
    if not program or not os.path.exists(program):
        import shmgrad

        program = shmgrad.program("shmgrad")  # raises, naming the fix
    env = dict(os.environ)
    env.setdefault(PYTHON_ENV, sys.executable)
    os.execve(program, [program, *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
