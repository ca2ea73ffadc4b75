#!/usr/bin/env bash
# Local mode: the whole pipeline on this machine, no Azure account (docs/local-mode.md).
#   bash scripts/local.sh [python -m local options: --scenario FILE --time-scale N --timeout S --policy FILE --json ...]
# Installs what is missing (scripts/bootstrap.sh, idempotent), then runs `python -m local`: Azurite and the IMDS,
# Event Hubs and Relay emulators, one forwarder process per simulated VM, the function host feeding function_app;
# a live timeline, then a summary. Exit 0 when every expectation held, 1 otherwise, 2 on bad options.
# Safe to run twice: runtime files live in .local/ (wiped at each start); every child stops on exit or Ctrl-C.
# Bounded: python -m local gives up after --timeout (240 s by default); the outer timeout is a backstop.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
# --foreground: Ctrl-C reaches python -m local, which stops its children; on expiry it gets SIGTERM (same cleanup).
exec timeout --foreground --kill-after=30 900 "$root/.venv/bin/python" -m local "$@"
