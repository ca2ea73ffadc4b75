#!/usr/bin/env bash
# Builds the forwarder package the VMs install as root (forwarder/ and contracts/, the envelope and approval contracts
# it shares with the coordinator, at the root of a tar.gz, forwarder/install.sh inside) and prints its SHA-256, which the deployment passes to cloud-init (forwarderPackageSha256): an instance installs only a
# download with exactly this digest. The archive is reproducible (sorted names, fixed times and owners, gzip
# without a timestamp), so the same sources give the same digest.
#   bash scripts/package-forwarder.sh [OUT_DIR]   (default: build/)  -> prints "<sha256>  <path>"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$root/build}" && cd "${1:-$root/build}" && pwd)"
cd "$root"
tar --sort=name --mtime='2000-01-01 00:00:00Z' --owner=0 --group=0 --numeric-owner \
  --exclude='__pycache__' --exclude='*.pyc' -cf - forwarder contracts | gzip -n -9 > "$out/forwarder.tar.gz"
sha256sum "$out/forwarder.tar.gz"
