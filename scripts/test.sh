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
echo "== pytest"; pytest "$@"
