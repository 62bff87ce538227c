"""Repository rules that locate libtorch and the Python headers.

Both come from ONE Python: the environment variable SHMGRAD_PYTHON, passed with
`--repo_env=SHMGRAD_PYTHON=/path/to/python` (tools/setup.sh writes it into .bazelrc.local:
the .venv of this checkout). Unset, it is <workspace>/.venv/bin/python. What a build needs
to know about that Python's torch (headers, libraries, the C++ ABI flag, pybind11's ABI
settings) is read by tools/torch_build_info.py, the script the CMake build asks too, so
that neither build hard-codes it.
"""

def _python(ctx):
    python = ctx.os.environ.get("SHMGRAD_PYTHON", "")
    if python == "":
        python = str(ctx.path(Label("//:WORKSPACE")).dirname) + "/.venv/bin/python"
    return python

def _torch_info(ctx):
    python = _python(ctx)
    script = ctx.path(Label("//tools:torch_build_info.py"))
    res = ctx.execute([python, str(script)], quiet = True)
    if res.return_code != 0:
        fail(("SHMGRAD_PYTHON=%s: cannot read its torch (%s%s). Run tools/setup.sh, or pass " +
              "--repo_env=SHMGRAD_PYTHON=/path/to/python of an environment with torch.") %
             (python, res.stdout, res.stderr))
    info = {}
    for line in res.stdout.strip().split("\n"):
        if "=" in line:
            k, v = line.split("=", 1)
            info[k] = v
    return python, info

def _torch_repository_impl(ctx):
    python, info = _torch_info(ctx)
    root = info["TORCH_ROOT"]
    lib = info["TORCH_LIBRARY_DIR"]
    inc = root + "/include"
    if not ctx.path(inc + "/torch/csrc/api/include/torch/torch.h").exists:
        fail("no libtorch headers under %s (torch/csrc/api/include/torch/torch.h)" % inc)
    for d in ctx.path(inc).readdir():
        ctx.symlink(d, "include/" + d.basename)
    defines = ["_GLIBCXX_USE_CXX11_ABI=" + info["TORCH_CXX11_ABI"]]
    pybind = [d for d in info["TORCH_PYBIND11_DEFINES"].split("|") if d]
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
# libtorch {version} of {python}
cc_library(
    name = "torch",
    hdrs = glob(["include/ATen/**", "include/c10/**", "include/torch/**", "include/caffe2/**",
                 "include/pybind11/**", "include/*.h"]),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = {defines},
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"],
)
cc_library(
    name = "torch_python",
    defines = {pybind},
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-ltorch_python"],
    deps = [":torch"],
)
""".format(version = info["TORCH_VERSION"], python = python, lib = lib,
           defines = repr(defines), pybind = repr(pybind)))

torch_repository = repository_rule(
    implementation = _torch_repository_impl,
    environ = ["SHMGRAD_PYTHON"],
    local = True,
)

def _python_repository_impl(ctx):
    python, info = _torch_info(ctx)
    ctx.symlink(info["PYTHON_INCLUDE"], "include/python")
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
