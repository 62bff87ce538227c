"""Repository rules that locate libtorch and Python headers.

libtorch's location is ONE build setting: the environment variable SHMGRAD_LIBTORCH,
passed with `--repo_env=SHMGRAD_LIBTORCH=DIR`. Unset (the default) means Debian's
libtorch-dev (headers in /usr/include, libraries in /usr/lib/x86_64-linux-gnu). Set it
to the `torch` directory of a PyTorch wheel (it holds include/ and lib/), e.g.
  bazel build --repo_env=SHMGRAD_LIBTORCH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))') //...
to build against that PyTorch (a GPU build must).
"""

_DEBIAN_INCLUDE = "/usr/include"
_DEBIAN_LIB = "/usr/lib/x86_64-linux-gnu"

def _torch_repository_impl(ctx):
    root = ctx.os.environ.get("SHMGRAD_LIBTORCH", "")
    if root in ("", "debian"):
        inc = _DEBIAN_INCLUDE
        lib = _DEBIAN_LIB
    else:
        inc = root + "/include"
        lib = root + "/lib"
    if not ctx.path(inc + "/torch/csrc/api/include/torch/torch.h").exists:
        fail("SHMGRAD_LIBTORCH: no libtorch headers under %s (expected torch/csrc/api/include/torch/torch.h). " % inc +
             "Set --repo_env=SHMGRAD_LIBTORCH to the torch/ directory of a PyTorch wheel, or install libtorch-dev.")
    for d in ["ATen", "c10", "torch", "caffe2"]:
        if ctx.path(inc + "/" + d).exists:
            ctx.symlink(inc + "/" + d, "include/" + d)
    has_cuda = ctx.path(lib + "/libc10_cuda.so").exists
    cuda_libs = '"-ltorch_cuda", "-lc10_cuda", ' if has_cuda else ""
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
# libtorch from {root}
cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"]),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = ["SHMGRAD_TORCH_HAS_CUDA={cuda}"],
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-Wl,--no-as-needed", {cuda_libs}"-ltorch", "-ltorch_cpu", "-lc10", "-Wl,--as-needed"],
)
cc_library(
    name = "torch_python",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-ltorch_python"],
    deps = [":torch"],
)
""".format(root = root or "Debian", lib = lib, cuda_libs = cuda_libs, cuda = "1" if has_cuda else "0"))

torch_repository = repository_rule(
    implementation = _torch_repository_impl,
    environ = ["SHMGRAD_LIBTORCH"],
    local = True,
)

def _python_repository_impl(ctx):
    python = ctx.os.environ.get("SHMGRAD_PYTHON", "/usr/bin/python3")
    res = ctx.execute([python, "-c", "import sysconfig, pybind11; print(sysconfig.get_paths()['include']); print(pybind11.get_include())"])
    if res.return_code != 0:
        res = ctx.execute([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include']); print('/usr/include')"])
    if res.return_code != 0:
        fail("SHMGRAD_PYTHON=%s: cannot query its include directory: %s" % (python, res.stderr))
    lines = res.stdout.strip().split("\n")
    ctx.symlink(lines[0], "include/python")
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
# Python headers of {python}
cc_library(
    name = "headers",
    hdrs = glob(["include/python/**/*.h"]),
    includes = ["include/python"],
)
""".format(python = python))

python_repository = repository_rule(
    implementation = _python_repository_impl,
    environ = ["SHMGRAD_PYTHON"],
    local = True,
)
