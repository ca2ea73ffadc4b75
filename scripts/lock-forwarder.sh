#!/usr/bin/env bash
# Refreshes forwarder/requirements.lock: every package the forwarder installs on a VM (forwarder/requirements.txt and
# what they need), pinned, with the SHA-256 of every file PyPI holds for that version. forwarder/install.sh installs
# it with `pip install --require-hashes`, so two VMs installed on different days run the same code. Run it after a
# change to forwarder/requirements.txt, or to take newer versions; commit the lock.
#   bash scripts/lock-forwarder.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root/forwarder"
CUSTOM_COMPILE_COMMAND="bash scripts/lock-forwarder.sh" "$root/.venv/bin/pip-compile" --quiet --generate-hashes \
  --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links --upgrade \
  --output-file requirements.lock requirements.txt
