#!/usr/bin/env bash
# Stages the Functions app (function_app.py, host.json, requirements.txt, coordinator/ and the forwarder's contract
# modules the coordinator imports) and zips it for `az functionapp deployment source config-zip` (Flex builds
# remotely from requirements.txt).   bash scripts/package-functions.sh [OUT_DIR]   (default: build/)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$root/build}" && cd "${1:-$root/build}" && pwd)"
# The only forwarder modules the coordinator may import: the contracts both sides share, declared once in
# pyproject.toml (the forwarder-contracts import rule, which lint-imports enforces).
mapfile -t contract_modules < <(python3 "$root/scripts/contract_modules.py")
rm -rf "$out/app" "$out/app.zip"
mkdir -p "$out/app/forwarder"
cd "$root"
cp -r function_app.py host.json requirements.txt coordinator "$out/app/"
for module in __init__ "${contract_modules[@]}"; do cp "forwarder/$module.py" "$out/app/forwarder/"; done
find "$out/app" -name '__pycache__' -prune -exec rm -rf {} +
(cd "$out/app" && python3 -m zipfile -c ../app.zip .)
echo "$out/app.zip"
