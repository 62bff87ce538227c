#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer, clang's -fsanitize=fuzzer,address,undefined) of every
# reader of untrusted bytes: one target per reader in tests/fuzz/<target>_fuzz.cc, each with
# its dictionary tests/fuzz/<target>.dict and seeds that tests/fuzz/make_seeds.cc writes
# from real segments and files (docs/FUZZING.md says what each target covers).
#
#   tools/fuzz.sh               every target for 60 s (--seconds N: N s each)
#   tools/fuzz.sh --ci          what CI runs (tools/test.sh): every kept regression input,
#                               then every target for a few seconds (about a minute in all,
#                               the build included)
#   tools/fuzz.sh --replay      only the kept regression inputs
#   tools/fuzz.sh --targets "a b"  only those targets
#
# The torch-free sources are compiled here with clang++ into build/fuzz (no Bazel). Per
# target it prints executions, edges covered (cov), features (ft) and crashes. A crash
# leaves its input in build/fuzz/crashes/<target>/ and the run goes on (the target is
# restarted for the time left); fix the reader, then keep the input as a regression test
# under tests/fuzz/regressions/<target>/ (replayed by --ci and by //tests:fuzz_regression_test).
# Exit status: 1 if any target crashed or a regression input fails.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
OUT="${SHMGRAD_FUZZ_DIR:-$ROOT/build/fuzz}"
SECONDS_EACH=60
MODE=fuzz
TARGETS="segment_header device_table step_request worker_record model_file npy idx spec_strings shm_group"
while [ $# -gt 0 ]; do
  case "$1" in
    --ci) MODE=ci; SECONDS_EACH=3 ;;
    --replay) MODE=replay ;;
    --seconds) SECONDS_EACH="$2"; shift ;;
    --targets) TARGETS="$2"; shift ;;
    *) echo "tools/fuzz.sh: unknown argument $1 (see the header of tools/fuzz.sh)" >&2; exit 2 ;;
  esac
  shift
done

CXX="${CXX_FUZZ:-clang++}"
command -v "$CXX" >/dev/null || { echo "tools/fuzz.sh: $CXX not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
SRCS="ipc/config.cc ipc/device_table.cc ipc/error.cc ipc/futex.cc ipc/segment.cc
  engine/model_file.cc engine/dataset.cc engine/control.cc engine/step_results.cc
  worker/step_request.cc backend/shm_comm.cc"
# shellcheck disable=SC2054  # commas inside one flag, not between elements
FLAGS=(-std=c++20 -gline-tables-only -O1 -I"$ROOT" -fno-omit-frame-pointer -fsanitize=address,undefined
  -fno-sanitize-recover=undefined)
LIBS=(-lz -lrt -lpthread)
mkdir -p "$OUT/obj" "$OUT/bin"

# Build: the readers' objects once (instrumented for coverage), then one binary per target.
# Rebuilt when a source or header under the readers' folders is newer than the last build.
stamp="$OUT/bin/.built"
missing=""
for t in $TARGETS; do [ -x "$OUT/bin/${t}_fuzz" ] || missing=1; done
if [ -n "$missing" ] || [ ! -e "$stamp" ] || [ -n "$(find ipc engine worker backend tests/fuzz \
    -newer "$stamp" \( -name '*.cc' -o -name '*.h' \) -print -quit)" ]; then
  t0=$SECONDS
  touch "$stamp.new"  # what changes while this builds is built next time
  objs=()
  for src in $SRCS; do objs+=("$OUT/obj/$(echo "$src" | tr / _).o"); done
  # As many compilers as cores; xargs fails if one does.
  export CXX OUT
  export FLAGS_TEXT="${FLAGS[*]}"
  # shellcheck disable=SC2016,SC2086  # one line per source; $CXX expands in sh
  printf '%s\n' $SRCS | xargs -P "$(nproc)" -I{} sh -c \
    '$CXX $FLAGS_TEXT -fsanitize=fuzzer-no-link -c {} -o "$OUT/obj/$(echo {} | tr / _).o"'
  # shellcheck disable=SC2016,SC2086
  printf '%s\n' $TARGETS | xargs -P "$(nproc)" -I{} sh -c \
    '$CXX $FLAGS_TEXT -fsanitize=fuzzer tests/fuzz/{}_fuzz.cc $0 -o "$OUT/bin/{}_fuzz"' \
    "${objs[*]} ${LIBS[*]}"
  "$CXX" "${FLAGS[@]}" tests/fuzz/make_seeds.cc "${objs[@]}" "${LIBS[@]}" -o "$OUT/bin/make_seeds"
  mv "$stamp.new" "$stamp"
  echo "fuzz: built ${TARGETS// /, } in $((SECONDS - t0)) s ($CXX)"
fi

# Seeds: written fresh from this build (they hold its sizes); the corpora grow across runs.
rm -rf "$OUT/seeds"
"$OUT/bin/make_seeds" "$OUT/seeds"

failed=0
# Every kept regression input: each must now be read without a crash.
for t in $TARGETS; do
  dir="tests/fuzz/regressions/$t"
  kept=0
  if [ -d "$dir" ]; then kept=$(find "$dir" -type f | wc -l); fi
  [ "$kept" -gt 0 ] || continue
  if "$OUT/bin/${t}_fuzz" -runs=1 "$dir"/* >"$OUT/replay-$t.log" 2>&1; then
    echo "fuzz: $t: $kept regression input(s) read without a crash"
  else
    echo "fuzz: $t: a regression input crashes it again:"
    tail -30 "$OUT/replay-$t.log"
    failed=1
  fi
done
[ "$MODE" = replay ] && exit "$failed"

printf '%-15s %12s %8s %8s %8s %7s\n' target executions cov ft corpus crashes
for t in $TARGETS; do
  corpus="$OUT/corpus/$t"
  crashes_dir="$OUT/crashes/$t"
  mkdir -p "$corpus" "$crashes_dir"
  cat "tests/fuzz/$t.dict" "$OUT/seeds/build.dict" >"$OUT/$t.dict"
  log="$OUT/$t.log"
  : >"$log"
  execs=0 crashes=0 cov=0 ft=0
  deadline=$((SECONDS + SECONDS_EACH))
  # A crash ends a libFuzzer run: restart it for the time left, keeping each crash's input.
  while [ $SECONDS -lt $deadline ]; do
    left=$((deadline - SECONDS))
    rc=0
    "$OUT/bin/${t}_fuzz" "$corpus" "$OUT/seeds/$t" -dict="$OUT/$t.dict" \
      -max_total_time="$left" -print_final_stats=1 -max_len=65536 -rss_limit_mb=2048 \
      -malloc_limit_mb=1024 -timeout=10 -artifact_prefix="$crashes_dir/" >>"$log" 2>&1 || rc=$?
    run_execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || echo 0)
    execs=$((execs + ${run_execs:-0}))
    line=$(grep -E '^#[0-9]+' "$log" | grep -o 'cov: [0-9]* ft: [0-9]*' | tail -1 || true)
    if [ -n "$line" ]; then
      cov=$(echo "$line" | awk '{print $2}')
      ft=$(echo "$line" | awk '{print $4}')
    fi
    [ $rc -eq 0 ] && break
    if [ -z "$(find "$crashes_dir" -type f -newer "$corpus" -print -quit)" ] &&
        [ "$(find "$crashes_dir" -type f | wc -l)" -le "$crashes" ]; then
      echo "fuzz: $t failed (rc $rc) without a crash input:" >&2
      tail -20 "$log" >&2
      crashes=$((crashes + 1))
      break
    fi
    crashes=$((crashes + 1))
    echo "fuzz: $t crashed (rc $rc); its input is in $crashes_dir/ (log: $log)" >&2
    grep -E '^(==[0-9]+==ERROR|SUMMARY|fuzz:|.*runtime error)' "$log" | tail -3 >&2 || true
    # Remove the stats of this run so that the next run's are read.
    sed -i 's/stat::number_of_executed_units/counted::number_of_executed_units/' "$log"
  done
  printf '%-15s %12s %8s %8s %8s %7s\n' "$t" "$execs" "$cov" "$ft" "$(find "$corpus" -type f | wc -l)" "$crashes"
  [ "$crashes" -eq 0 ] || failed=1
done
exit "$failed"
