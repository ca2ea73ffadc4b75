#!/usr/bin/env bash
# Installs what the project needs, idempotently: .venv (Python packages), .venv-iac (checkov), tools/node
# (Azurite, hyco-https, the Kusto language service, the Adaptive Cards renderer, playwright-core) and Debian's
# chromium (the card rendering and people's browser tests), and the emulators' local CA (.local/tls). A stamp of each requirement file's hash skips work already done; safe to run
# twice.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"

stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

venv_install() {  # venv_install DIR REQUIREMENTS...
  local dir="$1"; shift
  local digest; digest="$(cat "$@" | sha256sum | cut -d' ' -f1)"
  if [ ! -x "$dir/bin/python" ]; then "$python" -m venv "$dir"; fi
  if ! stamp_ok "$dir/.installed" "$digest"; then
    echo "bootstrap: installing $* into $dir" >&2
    "$dir/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
    local args=(); for req in "$@"; do args+=(-r "$req"); done
    "$dir/bin/pip" install --quiet --disable-pip-version-check "${args[@]}"
    echo "$digest" > "$dir/.installed"
  fi
}

venv_install .venv requirements-dev.txt requirements.txt forwarder/requirements.txt ops/requirements.txt
venv_install .venv-iac requirements-iac.txt
# The local CA and the emulators' server certificate (emulators/tls.py; made once, kept under .local/tls, never committed).
.venv/bin/python -m emulators.tls >&2

node_digest="$(cat tools/node/package.json tools/node/package-lock.json | sha256sum | cut -d' ' -f1)"
if ! stamp_ok tools/node/node_modules/.installed "$node_digest"; then
  echo "bootstrap: npm ci in tools/node" >&2
  (cd tools/node && npm ci --no-audit --no-fund --loglevel=error)
  echo "$node_digest" > tools/node/node_modules/.installed
fi

# Debian's Chromium, which the card rendering and people's browser tests drive (tools/node/render-cards.js and
# browser.js; playwright-core cannot download a browser here). CI runs as root on a fresh machine with apt access.
# If it cannot be installed, the rest goes on and those tests fail saying so (they never skip).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: apt-get install chromium" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
      echo "bootstrap: could not install chromium; the card rendering and browser tests will fail" >&2
    fi
  else
    echo "bootstrap: /usr/bin/chromium is missing and this is not root with apt-get: install Debian's chromium" \
      "package for the card rendering and browser tests" >&2
  fi
fi
