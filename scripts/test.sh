#!/usr/bin/env bash
# Runs every check: lint (ruff), types (mypy), the import rules (lint-imports; contracts in pyproject.toml) and all
# tests (pytest: unit, protocol, end-to-end, infra).
# Installs what it needs first (scripts/bootstrap.sh). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
export PATH="$root/.venv/bin:$PATH"
echo "== ruff"; ruff check .
echo "== mypy"; mypy .
echo "== import rules"; lint-imports --no-cache
# Two passes. Everything but the whole-stack runs on two workers (pytest-xdist; PYTEST_WORKERS to change); then the
# whole-stack runs (marked slow: emulators, a forwarder process per VM, the coordinator), two at a time
# (PYTEST_SLOW_WORKERS): each spends most of its time waiting on emulated time (about a tenth of a core on average),
# so two share the machine without their latency bounds moving (measured: 52 runs in 9 min instead of 15, each run
# within a few seconds of its time alone). Both passes run; the exit status is the first failure's.
# Pass 5 ("no tests collected": e.g. a path with no whole-stack run) is not a failure.
# A whole-stack run that fails is run once more (pytest-rerunfailures; the summary counts it as "rerun" and prints the
# first failure's traceback: --rerun-show-tracebacks). A rerun is a lead, not noise: each one found so far was a real
# bug (docs/oracle.md, Found since).
status=0
echo "== pytest: all but the whole-stack runs, on ${PYTEST_WORKERS:-2} workers"
pytest -n "${PYTEST_WORKERS:-2}" -m "not slow" "$@" || { code=$?; [ "$code" -eq 5 ] || status=$code; }
echo "== pytest: the whole-stack runs, ${PYTEST_SLOW_WORKERS:-2} at a time"
pytest -n "${PYTEST_SLOW_WORKERS:-2}" -m slow --durations=50 --reruns 1 --reruns-delay 2 --rerun-show-tracebacks "$@" || { code=$?; [ "$code" -eq 5 ] || [ "$status" -ne 0 ] || status=$code; }
# Every benchmark, short and once: it must run, give its keys and be valid (its run what it claims to measure: no
# dead-lettered wave, the approvals it expects); no figure is asserted (figures: python -m benchmarks --record).
# Only for the whole suite (no extra arguments).
if [ $# -eq 0 ]; then
  echo "== benchmarks --quick: every benchmark runs and is valid"
  mkdir -p .local
  python -m benchmarks --quick > .local/benchmarks-quick.json || { code=$?; [ "$status" -ne 0 ] || status=$code; }
fi
exit "$status"
