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
# Two workers (PYTEST_WORKERS to change): the whole-stack runs keep to one of them, in turn (tests/conftest.py),
# the rest share both. Suite time on 2 cores: see README, *Tests*.
echo "== pytest"; pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
