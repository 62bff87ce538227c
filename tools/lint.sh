#!/usr/bin/env bash
# The house style, checked (tools/test.sh runs this first; CI on every change):
#   Python: ruff format and ruff check (settings in pyproject.toml; 100 columns)
#   C++:    clang-format (.clang-format: Google's style, 100 columns)
#   commits after the style was adopted: subjects of at most 72 characters
#   tools/lint.sh --fix   rewrites the files instead of checking them
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF="${SHMGRAD_VENV:-.venv}/bin/ruff"
[ -x "$RUFF" ] || RUFF=ruff
CPP_FILES=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
# The commit that adopted tools/lint.sh; its subject and those after it are checked.
STYLE_SINCE=b0f7aa2
if [ "${1:-}" = "--fix" ]; then
  "$RUFF" format .
  "$RUFF" check --fix .
  # shellcheck disable=SC2086
  clang-format -i $CPP_FILES
  exit 0
fi
status=0
"$RUFF" format --check . >/dev/null || { echo "lint: ruff format would change files:"; \
  "$RUFF" format --check . || true; echo "lint: run tools/lint.sh --fix"; status=1; }
"$RUFF" check . || { echo "lint: ruff check failed (tools/lint.sh --fix fixes some)"; status=1; }
# shellcheck disable=SC2086
clang-format --dry-run --Werror $CPP_FILES || { echo "lint: clang-format: run tools/lint.sh --fix"; status=1; }
if git cat-file -e "$STYLE_SINCE^{commit}" 2>/dev/null; then
  long=$(git log --format='%s' "$STYLE_SINCE..HEAD" | awk 'length($0) > 72')
  if [ -n "$long" ]; then
    echo "lint: commit subjects over 72 characters (put details in the body):"
    echo "$long"
    status=1
  fi
fi
[ $status -eq 0 ] && echo "lint: ok (ruff format, ruff check, clang-format, commit subjects)"
exit $status
