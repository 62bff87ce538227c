#!/usr/bin/env bash
# Runs every test: the C++ suites through Bazel under AddressSanitizer+UBSan (every test,
# and the C++ example built; the synchronisation also under ThreadSanitizer), a minute and
# a half of fuzzing of every reader of untrusted bytes, its clang build included, with its
# kept crash inputs (tools/fuzz.sh --ci: clang's libFuzzer, docs/FUZZING.md), the Python
# suite against the newest torch (.venv), then the pip build and the Python tests of the
# core against the oldest supported torch (2.11, .venv-2.11). Runs tools/setup.sh first
# (installs what is missing, builds and installs the package; the plain Bazel build is
# left out: the C++ tests are built once, with the sanitizers, which is what keeps CI
# under 40 minutes).
#   SHMGRAD_SKIP_OLDEST=1   leave out the torch 2.11 environment
#   --full                  also the long Python tests (marked `full`: several ranks,
#                           nodes, restarts), which CI leaves out to stay under 40 minutes
set -euo pipefail
if [ "${1:-}" = "--full" ]; then export SHMGRAD_TEST_FULL=1; fi
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
SECONDS=0
stamp() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }
OLDEST_SPEC="torch==2.11.* torchvision==0.26.*"
OLDEST_VENV="$ROOT/.venv-2.11"

stamp "set-up (tools/setup.sh)"
SHMGRAD_BAZEL_CONFIGURE_ONLY=1 tools/setup.sh
stamp "house style (tools/lint.sh)"
tools/lint.sh
if [ -z "${SHMGRAD_SKIP_OLDEST:-}" ]; then
  # The oldest torch's packages download while the C++ tests build and run (the network,
  # not the cores, is what that costs); tools/setup.sh then finds them installed.
  stamp "downloading the oldest supported torch into .venv-2.11 (in the background)"
  mkdir -p "$ROOT/build"
  (
    [ -x "$OLDEST_VENV/bin/python" ] || /usr/bin/python3 -m venv "$OLDEST_VENV"
    # shellcheck disable=SC2086
    "$OLDEST_VENV/bin/python" -m pip install -q --disable-pip-version-check \
      -r tools/requirements.txt $OLDEST_SPEC
  ) > "$ROOT/build/oldest-download.log" 2>&1 &
  OLDEST_DOWNLOAD=$!
fi
trap 'bazel shutdown >/dev/null 2>&1 || true' EXIT  # leave no Bazel server behind
FILTER='^(Loading|Analyzing|INFO: (Analyzed|Found|From)|\[)'
stamp "C++ tests under AddressSanitizer+UBSan: bazel test --config=asan //tests/... //examples/..."
# Every BUILD file is analysed; what the tests and examples do not need (the extension,
# reduce_bench) the pip build has compiled from the same sources (test_build.py checks).
bazel build --config=asan --nobuild //... 2>&1 | grep -Ev "$FILTER"
bazel test --config=asan //tests/... //examples/... 2>&1 | grep -Ev "$FILTER"
stamp "synchronisation under ThreadSanitizer (clang; GCC 12's libtsan crashes on this kernel)"
TSAN_BASE="${SHMGRAD_TSAN_OUTPUT_BASE:-$HOME/.cache/shmgrad-bazel-tsan}"
CC=clang bazel --output_base="$TSAN_BASE" \
  test --config=tsan --repo_env=CC=clang --symlink_prefix=/ //tests:sync_test //tests:ipc_test //tests:shm_comm_test 2>&1 | grep -Ev "$FILTER"
bazel --output_base="$TSAN_BASE" shutdown  # this second Bazel server is ours to stop
bazel shutdown  # frees its memory for the Python suites
stamp "fuzzing every reader of untrusted bytes briefly, and its kept crash inputs (tools/fuzz.sh --ci)"
tools/fuzz.sh --ci

TORCH="$(.venv/bin/python -c 'import torch; print(torch.__version__)')"
stamp "Python tests against torch $TORCH: pytest tests/python"
# An unclosed file or socket is an error (-W error::ResourceWarning).
(cd tests/python && "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider -W error::ResourceWarning .)

if [ -z "${SHMGRAD_SKIP_OLDEST:-}" ]; then
  # The oldest supported torch: its own environment, the pip build against it, and the
  # Python tests of the engine, the builds, and of the eager workers what touches torch's
  # API most (a custom loss with transforms, Adam steps, parametrizations, serve --eager,
  # a kill mid-step, the gradient hooks of the bucketed reduction, a step the trainer
  # computes itself); the rest of the suite, the launcher's tests against stand-in
  # programs, the fake device's, the wheel test and the device-check dry run are left to
  # the newest torch, to keep CI under 40 minutes.
  wait "$OLDEST_DOWNLOAD" || { cat "$ROOT/build/oldest-download.log"; exit 1; }
  stamp "the oldest supported torch: .venv-2.11"
  SHMGRAD_VENV="$OLDEST_VENV" SHMGRAD_TORCH_SPEC="$OLDEST_SPEC" SHMGRAD_SKIP_BAZEL=1 tools/setup.sh
  TORCH_OLD="$("$OLDEST_VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  stamp "Python tests against torch $TORCH_OLD: pytest tests/python (the core)"
  (cd tests/python && "$OLDEST_VENV/bin/python" -m pytest -q -p no:cacheprovider \
    -m "not newest_torch_only" test_build.py test_engine.py \
    test_eager.py::test_unscriptable_model_custom_loss_dataset_transforms_match_one_process \
    test_eager.py::test_twenty_adam_steps_agree_with_plain_pytorch \
    test_eager.py::test_parametrized_modules_reach_eager_workers_and_train_exactly \
    test_eager.py::test_serve_eager_module_function_and_attach \
    test_eager.py::test_worker_killed_mid_step_is_retried_exactly \
    test_in_trainer.py::test_the_trainer_computes_a_workers_step_exactly \
    test_buckets.py::test_bucketed_gradients_are_the_unbucketed_ones_bit_for_bit \
    test_backend.py::test_collectives_give_gloos_bits \
    test_backend.py::test_ddp_gives_the_parameters_of_ddp_with_gloo)
fi
stamp "all tests done"
