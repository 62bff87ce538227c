#!/usr/bin/env bash
# Runs every test: the C++ suites through Bazel, then the Python suites through pytest.
# Runs tools/setup.sh first (installs what is missing, builds, installs the package).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
echo "== C++ tests: bazel test //..."
bazel test //... 2>&1 | grep -Ev "^(Loading|Analyzing|INFO: (Analyzed|Found|From)|\[)" 
FILTER='^(Loading|Analyzing|INFO: (Analyzed|Found|From)|\[)'
echo "== C++ tests under AddressSanitizer+UBSan: ipc, replica, engine"
bazel test --config=asan //tests:ipc_test //tests:sync_test //tests:replica_test //tests:engine_test 2>&1 | grep -Ev "$FILTER"
echo "== synchronisation under ThreadSanitizer (clang; GCC 12's libtsan crashes on this kernel)"
TSAN_BASE="${SHMGRAD_TSAN_OUTPUT_BASE:-$HOME/.cache/shmgrad-bazel-tsan}"
CC=clang bazel --output_base="$TSAN_BASE" \
  test --config=tsan --repo_env=CC=clang --symlink_prefix=/ //tests:sync_test //tests:ipc_test 2>&1 | grep -Ev "$FILTER"
bazel --output_base="$TSAN_BASE" shutdown  # this second Bazel server is ours to stop
echo "== Python tests: pytest tests/python"
trap 'bazel shutdown >/dev/null 2>&1 || true' EXIT  # leave no Bazel server behind
cd tests/python && /usr/bin/python3 -m pytest -q -p no:cacheprovider .
