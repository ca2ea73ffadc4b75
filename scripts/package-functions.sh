#!/usr/bin/env bash
# Stages the Functions app (function_app.py, host.json, requirements.txt, coordinator/ and contracts/, the package the
# coordinator shares with the forwarder) and zips it for `az functionapp deployment source config-zip` (Flex builds
# remotely from requirements.txt). Operator tools (ops/) and local-only code never ship: the import rules in
# pyproject.toml keep the coordinator from importing them.   bash scripts/package-functions.sh [OUT_DIR]   (default: build/)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$root/build}" && cd "${1:-$root/build}" && pwd)"
rm -rf "$out/app" "$out/app.zip"
mkdir -p "$out/app"
cd "$root"
cp -r function_app.py host.json requirements.txt coordinator contracts "$out/app/"
find "$out/app" -name '__pycache__' -prune -exec rm -rf {} +
(cd "$out/app" && python3 -m zipfile -c ../app.zip .)
echo "$out/app.zip"
