"""What a C++ build needs to know about the torch installed in this Python, read from
torch itself: both builds (CMakeLists.txt, third_party/repositories.bzl) ask this script,
so neither hard-codes an ABI flag, a path or a pybind11 setting.

    python tools/torch_build_info.py     prints KEY=VALUE lines; a list's items are
                                         separated by LIST_SEPARATOR
"""

import argparse
import os
import sys
import sysconfig

# The oldest torch shmgrad supports; the README's status table names the tested ones.
MIN_TORCH = (2, 11)
LIST_SEPARATOR = "|"


def info() -> dict:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise SystemExit(
            f"torch is not installed in {sys.executable} ({exc}): pip install torch"
        ) from exc
    if torch.__version__ < MIN_TORCH:  # a TorchVersion: compares with tuples
        raise SystemExit(
            f"torch {torch.__version__} in {sys.executable} is older than shmgrad supports "
            f"(>= {'.'.join(map(str, MIN_TORCH))}): pip install --upgrade torch"
        )
    root = os.path.dirname(torch.__file__)
    pybind = []
    # torch releases that record pybind11's ABI settings export them; an extension that
    # exchanges objects with torch's own must be built with the same ones.
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            pybind.append(f'PYBIND11_{name}="{value}"')
    return {
        "TORCH_VERSION": torch.__version__,
        "TORCH_ROOT": root,
        "TORCH_INCLUDE_DIRS": LIST_SEPARATOR.join(cpp_extension.include_paths()),
        "TORCH_LIBRARY_DIR": os.path.join(root, "lib"),
        "TORCH_CXX11_ABI": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "TORCH_PYBIND11_DEFINES": LIST_SEPARATOR.join(pybind),
        "TORCH_HAS_CUDA": str(int(torch.version.cuda is not None)),
        "PYTHON_INCLUDE": sysconfig.get_paths()["include"],
    }


def main():
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    for key, value in info().items():
        print(f"{key}={value}")


if __name__ == "__main__":
    main()
