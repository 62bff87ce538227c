#!/usr/bin/env bash
# One-time set-up on a Debian 12 machine (idempotent, quick when already done):
#   1. installs the Debian packages shmgrad needs (apt-get; as root or through sudo),
#   2. builds everything with Bazel (offline),
#   3. installs the Python package for /usr/bin/python3 (a .pth file pointing at
#      python/ in this checkout) and the `shmgrad` command (/usr/local/bin/shmgrad).
# Set SHMGRAD_LIBTORCH=DIR to build against the libtorch of a PyTorch wheel instead of
# Debian's (see third_party/repositories.bzl).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

PACKAGES=(bazel-bootstrap bazel-rules-java libtorch-dev libboost-dev pybind11-dev python3-dev
          python3-torch python3-pytest python3-numpy libopenblas0-pthread dataset-fashion-mnist
          libgtest-dev zlib1g-dev python3-matplotlib python3-distributed clang libclang-rt-14-dev
          libcli11-dev python3-cloudpickle python3-torchvision)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

BAZEL_FLAGS=()
if [ -n "${SHMGRAD_LIBTORCH:-}" ]; then BAZEL_FLAGS+=("--repo_env=SHMGRAD_LIBTORCH=$SHMGRAD_LIBTORCH"); fi
echo "setup: building (bazel build //...)"
bazel build "${BAZEL_FLAGS[@]}" //... 2>&1 | grep -Ev "^(Loading|Analyzing|INFO: (Analyzed|Found|Elapsed|From)|\[)" || true
test -f bazel-bin/tools/shmgrad -a -f bazel-bin/python/_C.so || { echo "setup: build failed" >&2; exit 1; }

# The package: python/shmgrad with the extension and the binary next to it.
install -m 0755 bazel-bin/python/_C.so python/shmgrad/_C.so
mkdir -p python/shmgrad/bin
install -m 0755 bazel-bin/tools/shmgrad python/shmgrad/bin/shmgrad
install -m 0755 bazel-bin/tools/reduce_bench python/shmgrad/bin/reduce_bench
SITE="$(/usr/bin/python3 -c 'import site; print(site.getsitepackages()[0])')"
echo "$ROOT/python" | $SUDO tee "$SITE/shmgrad.pth" >/dev/null
$SUDO ln -sf "$ROOT/python/shmgrad/bin/shmgrad" /usr/local/bin/shmgrad
(cd / && /usr/bin/python3 -c "import shmgrad" ) || { echo "setup: import shmgrad failed" >&2; exit 1; }
echo "setup: done (python3 -c 'import shmgrad'; shmgrad --help)"
