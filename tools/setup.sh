#!/usr/bin/env bash
# One-time set-up of this checkout on a Debian 12 machine (idempotent, quick when done):
#   1. installs the Debian packages the build and the tests need (apt-get; as root or
#      through sudo): Bazel, Boost.Interprocess and CLI11 headers, GoogleTest, clang for
#      ThreadSanitizer, Python's venv and headers, the Fashion-MNIST data set;
#   2. creates the virtual environment .venv with the newest supported torch and
#      torchvision and everything in tools/requirements.txt, from the package index;
#   3. builds shmgrad against that torch and installs it into .venv
#      (pip install --no-build-isolation .: CMake through scikit-build-core);
#   4. builds the C++ tests and tools with Bazel against the same torch (.bazelrc.local).
# Afterwards: .venv/bin/python runs the examples, .venv/bin/shmgrad is the command.
#
#   SHMGRAD_VENV=DIR          another environment (default .venv)
#   SHMGRAD_TORCH_SPEC=SPEC   pin torch and torchvision (tools/test.sh uses it for 2.11),
#                             e.g. "torch==2.11.* torchvision==0.26.*"
#   SHMGRAD_SKIP_BAZEL=1      the pip build only
#   SHMGRAD_BAZEL_CONFIGURE_ONLY=1
#                             write .bazelrc.local but build nothing with Bazel
#                             (tools/test.sh builds the C++ tests with sanitizers)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${SHMGRAD_VENV:-$ROOT/.venv}"

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# iproute2: ip and tc, with which tests/python/test_partition.py cuts nodes apart.
PACKAGES=(bazel-bootstrap bazel-rules-java libboost-dev libcli11-dev libgtest-dev zlib1g-dev
          cmake clang clang-format libclang-rt-14-dev python3-venv python3-dev dataset-fashion-mnist
          iproute2)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Debian's Python, in a virtual environment of its own: the index's torch and friends.
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  /usr/bin/python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
REQUIREMENTS=(-r "$ROOT/tools/requirements.txt")
if [ -n "${SHMGRAD_TORCH_SPEC:-}" ]; then
  # shellcheck disable=SC2206
  REQUIREMENTS+=($SHMGRAD_TORCH_SPEC)
fi
echo "setup: python packages (tools/requirements.txt${SHMGRAD_TORCH_SPEC:+ with $SHMGRAD_TORCH_SPEC})"
"$PY" -m pip install -q --disable-pip-version-check "${REQUIREMENTS[@]}"
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"

# The pip build, against that torch; one CMake build folder per torch (incremental).
echo "setup: building shmgrad against torch $TORCH_VERSION (pip install --no-build-isolation .)"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
  --config-settings="build-dir=$ROOT/build/torch-$TORCH_VERSION" "$ROOT" \
  || { echo "setup: the pip build failed" >&2; exit 1; }
(cd / && "$PY" -c "import shmgrad") || { echo "setup: import shmgrad failed" >&2; exit 1; }

if [ -z "${SHMGRAD_SKIP_BAZEL:-}" ]; then
  # Bazel builds against the same torch and Python headers.
  cat > "$ROOT/.bazelrc.local" <<EOF
# Written by tools/setup.sh: Bazel builds against the torch of $VENV.
build --repo_env=SHMGRAD_PYTHON=$PY
EOF
  if [ -z "${SHMGRAD_BAZEL_CONFIGURE_ONLY:-}" ]; then
    echo "setup: building the C++ tests and tools (bazel build //...)"
    bazel build //... 2>&1 | grep -Ev "^(Loading|Analyzing|INFO: (Analyzed|Found|Elapsed|From)|\[)" || true
    test -f bazel-bin/tools/shmgrad -a -f bazel-bin/python/_C.so || { echo "setup: bazel build failed" >&2; exit 1; }
  fi
fi
echo "setup: done ($VENV/bin/python -c 'import shmgrad'; $VENV/bin/shmgrad --help)"
