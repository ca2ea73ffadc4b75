#!/usr/bin/env bash
# Builds the forwarder package the VMs install as root (forwarder/ and contracts/, the envelope and approval contracts
# it shares with the coordinator, at the root of a tar.gz, forwarder/install.sh inside) and prints its SHA-256, which
# the deployment passes to cloud-init (forwarderPackageSha256): an instance installs only a download with exactly this
# digest. The package carries its dependencies' wheels (forwarder/wheels/: every file of forwarder/requirements.lock
# for the VM image's Python and architecture), which install.sh installs with `pip --no-index --require-hashes`: a VM
# needs no package index, so a fleet without outbound internet installs it, and no boot depends on PyPI.
# The wheels come from the local pip cache or PyPI here, at build time, checked against the lock's hashes. The
# archive is reproducible (sorted names, fixed times and owners, gzip without a timestamp; the wheels are the
# lock's exact files), so the same sources give the same digest.
#   bash scripts/package-forwarder.sh [OUT_DIR] [--python X.Y] [--arch ARCH]   -> prints "<sha256>  <path>"
#   OUT_DIR defaults to build/; --python 3.12 and --arch x86_64 are the VM image's (infra/modules/vmss.bicep:
#   Ubuntu 24.04 LTS, whose python3 is 3.12, on vmSize Standard_D2s_v5, x86_64); tests build for their own Python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_arg="" python_version="3.12" arch="x86_64"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python_version="${2:?}"; shift 2 ;;
    --arch) arch="${2:?}"; shift 2 ;;
    *) out_arg="$1"; shift ;;
  esac
done
out="$(mkdir -p "${out_arg:-$root/build}" && cd "${out_arg:-$root/build}" && pwd)"
pip="$root/.venv/bin/pip"
[ -x "$pip" ] || pip="pip"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cd "$root"
tar --exclude='__pycache__' --exclude='*.pyc' --exclude='forwarder/wheels' -cf - forwarder contracts | tar -xf - -C "$stage"
abi="cp${python_version/./}"
# --no-deps: the lock already lists every package; --require-hashes: each file is the one the lock names.
"$pip" download --quiet --disable-pip-version-check --no-deps --require-hashes --only-binary=:all: \
  --python-version "$python_version" --implementation cp --abi "$abi" --abi abi3 --abi none \
  --platform "manylinux_2_17_${arch}" --platform "manylinux2014_${arch}" --platform "manylinux_2_28_${arch}" \
  --platform any --dest "$stage/forwarder/wheels" -r forwarder/requirements.lock >&2
cd "$stage"
tar --sort=name --mtime='2000-01-01 00:00:00Z' --owner=0 --group=0 --numeric-owner -cf - forwarder contracts \
  | gzip -n -9 > "$out/forwarder.tar.gz"
sha256sum "$out/forwarder.tar.gz"
