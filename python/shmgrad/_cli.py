"""The ``shmgrad`` command of an installed package (``pip install``'s console script):
runs the native program that ships in the package's ``bin/``, telling it which Python
runs ``shmgrad stress``, ``shmgrad bench`` and ``serve --eager``: this one, whose
environment has torch and shmgrad."""

import os
import sys

from ._launcher import installed_binary

PYTHON_ENV = "SHMGRAD_PYTHON"  # read by the native program (tools/shmgrad_main.cc)


def main():
    program = installed_binary("shmgrad", "SHMGRAD_BINARY")
    env = dict(os.environ)
    env.setdefault(PYTHON_ENV, sys.executable)
    os.execve(program, [program, *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
