"""Fails when a built shared object carries its own copy of libstdc++.

torch uses the system's shared libstdc++, and shmgrad's extension exchanges C++ objects
and streams with it. A compiler that links libstdc++ statically (`-static-libstdc++`, or a
wrapper that adds it: the GPU machine's /opt/gcc/bin/g++ did, 2026-12-04) builds an
extension that crashes at its first stream read under GCC 13, where streams are set up
inside the library. The CMake build runs this after linking the extension, so such a
compiler fails the build with the fix instead of a segfault at run time.

    python tools/check_extension_link.py FILE.so     exit 0, or 1 with the reason
"""

import argparse
import shutil
import subprocess
import sys

# Definitions that only libstdc++ itself holds: none is a template a header instantiates.
LIBSTDCXX_OWN = (
    "_ZNKSt7codecvtIwc11__mbstate_tE10do_unshiftERS0_PcS3_RS3_",  # codecvt<wchar_t>::do_unshift
    "_ZNSt8ios_base4InitC1Ev",  # ios_base::Init::Init()
)


def libstdcxx_copies(path):
    """The libstdc++-only symbols that `path` defines; None when nm is not there."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    res = subprocess.run(
        [nm, "--dynamic", "--defined-only", path], capture_output=True, text=True, check=True
    )
    defined = {line.split()[-1].split("@")[0] for line in res.stdout.splitlines() if line.strip()}
    return [s for s in LIBSTDCXX_OWN if s in defined]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--compiler", default="the C++ compiler", help="named in the message")
    args = ap.parse_args(argv)
    found = libstdcxx_copies(args.file)
    if found is None:
        print(f"check_extension_link: no nm; {args.file} not checked", file=sys.stderr)
        return 0
    if found:
        print(
            f"{args.file} carries its own copy of libstdc++ (it defines {found[0]}): "
            f"{args.compiler} links libstdc++ statically (-static-libstdc++ in LDFLAGS, or a "
            "compiler wrapper that adds it). torch uses the shared libstdc++, and the "
            "extension would crash at its first stream read. Build with a compiler that "
            "links it dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install "
            "--no-build-isolation . (and remove the old build folder).",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
