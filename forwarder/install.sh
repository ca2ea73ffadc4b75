#!/usr/bin/env bash
# Installs the Scheduled Events forwarder on a Linux VM (run as root from a checkout of this repository):
#   sudo forwarder/install.sh --eventhub-namespace NS.servicebus.windows.net --eventhub-name scheduled-events \
#        [--client-id UAMI_CLIENT_ID] [--relay-namespace NS.servicebus.windows.net]
# Creates the se-forwarder system user, a venv under /opt/scheduled-events-forwarder with forwarder/requirements.lock
# (pinned and hashed: pip install --require-hashes, so every VM runs the same dependencies; scripts/lock-forwarder.sh)
# from the wheels the package carries (forwarder/wheels/, scripts/package-forwarder.sh; --no-index: no internet), the
# hook folders, /etc/scheduled-events/forwarder.yaml (kept if it exists) and the hardened systemd unit, then
# enables and starts it. Safe to run again (upgrades the code and the venv, keeps the settings and the spool).
# --root DIR installs into DIR instead of / (image building, tests): no user, no chown, no systemctl.
# --skip-venv leaves the venv alone (tests; or when the image already has it).
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root=""
skip_venv=0
eventhub_namespace=""
eventhub_name="scheduled-events"
client_id=""
relay_namespace=""
python="${PYTHON:-python3}"

die() { echo "install.sh: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --eventhub-namespace) eventhub_namespace="${2:?}"; shift 2 ;;
    --eventhub-name) eventhub_name="${2:?}"; shift 2 ;;
    --client-id) client_id="${2:?}"; shift 2 ;;
    --relay-namespace) relay_namespace="${2:?}"; shift 2 ;;
    --root) root="${2:?}"; shift 2 ;;
    --skip-venv) skip_venv=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ -n "$root" ] || [ "$(id -u)" -eq 0 ] || die "run as root (or with --root DIR)"

user=se-forwarder
opt="$root/opt/scheduled-events-forwarder"
etc="$root/etc/scheduled-events"
unit_dir="$root/etc/systemd/system"
config="$etc/forwarder.yaml"

if [ -z "$root" ] && ! id "$user" >/dev/null 2>&1; then
  useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$user"
fi

install -d -m 0755 "$opt" "$opt/app" "$unit_dir"
install -d -m 0750 "$etc" "$etc/hooks" "$etc/hooks/prepare.d" "$etc/hooks/recover.d"
# The code: the forwarder package and the contracts it shares with the coordinator (it imports nothing else).
for package in forwarder contracts; do
  rm -rf "$opt/app/$package.new"
  mkdir -p "$opt/app/$package.new"
  cp "$src/$package"/*.py "$opt/app/$package.new/"
done
cp "$src/forwarder/requirements.txt" "$src/forwarder/requirements.lock" "$opt/app/forwarder.new/"
# Byte-compiled here, once: the unit runs with PYTHONDONTWRITEBYTECODE=1 under ProtectSystem=strict (it could not
# write them anyway), so without them every start compiles every module again, and the compiler's memory stays in
# the daemon's RSS (3 MiB, most of it for the generated contracts/wire_validators.py: docs/forwarder.md,
# *Footprint*). checked-hash:
# valid whatever the files' times (an image build may reset them), and a source edited on the VM is still the one
# that runs (its hash no longer matches, so it is compiled as before). With the Python that runs them: the venv's,
# or on a first install the one the venv is made from below.
compiler="$python"
[ -x "$opt/venv/bin/python" ] && compiler="$opt/venv/bin/python"
"$compiler" -m compileall -q --invalidation-mode checked-hash "$opt/app/forwarder.new" "$opt/app/contracts.new" \
  >/dev/null || die "could not byte-compile the forwarder with $compiler"
for package in forwarder contracts; do
  rm -rf "${opt:?}/app/$package"
  mv "$opt/app/$package.new" "$opt/app/$package"
done

if [ "$skip_venv" -eq 0 ]; then
  [ -x "$opt/venv/bin/python" ] || "$python" -m venv "$opt/venv"
  [ -d "$src/forwarder/wheels" ] || die "no forwarder/wheels/: install from the package scripts/package-forwarder.sh builds"
  # No index: only the wheels the package carries, each checked against the lock's hashes.
  "$opt/venv/bin/pip" install --quiet --disable-pip-version-check --no-index --find-links "$src/forwarder/wheels" \
    --require-hashes --no-deps -r "$opt/app/forwarder/requirements.lock"
fi

if [ ! -f "$config" ]; then
  [ -n "$eventhub_namespace" ] || die "--eventhub-namespace is required for a first install (no $config yet)"
  umask 027
  {
    echo "# Scheduled Events forwarder settings (see docs/forwarder.md). SE_FORWARDER_* variables and flags override."
    echo "sink: eventhub"
    echo "eventhub_namespace: $eventhub_namespace"
    echo "eventhub_name: $eventhub_name"
    if [ -n "$client_id" ]; then echo "managed_identity_client_id: $client_id"; fi
    echo "hooks_dir: /etc/scheduled-events/hooks"
    echo "state_dir: /var/lib/scheduled-events-forwarder"
    echo "# Record spans (docs/forwarder.md, Health and tracing); under state_dir, the unit's one writable place:"
    echo "# telemetry_spans_file: /var/lib/scheduled-events-forwarder/spans.jsonl"
    if [ -n "$relay_namespace" ]; then
      echo "relay_enabled: true"
      echo "relay_namespace: $relay_namespace"
    fi
  } > "$config"
  umask 022
fi

install -m 0644 "$src/forwarder/systemd/scheduled-events-forwarder.service" "$unit_dir/"

if [ -z "$root" ]; then
  chown -R root:"$user" "$etc"
  chmod 0640 "$config"
  systemctl daemon-reload
  systemctl enable scheduled-events-forwarder.service
  systemctl restart scheduled-events-forwarder.service
  echo "install.sh: started; follow it with: journalctl -u scheduled-events-forwarder -f" >&2
fi
