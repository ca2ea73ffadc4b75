#!/usr/bin/env bash
# Local mode, first version: the IMDS emulator plays a scenario for a small simulated fleet and one forwarder per
# VM forwards what it sees to a JSON-lines file, printed here as a timeline. No Azure account needed.
#   bash scripts/local.sh [--scenario FILE] [--time-scale N] [--duration SECONDS]
# Stops by itself after --duration (default: the scenario's length plus the events' lifetimes) or on Ctrl-C.
# Everything lives in a fresh temporary folder (kept with --keep), so running it twice is safe.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

scenario="emulators/scenarios/fleet-demo.yaml"
time_scale=60
duration=""
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --scenario) scenario="${2:?}"; shift 2 ;;
    --time-scale) time_scale="${2:?}"; shift 2 ;;
    --duration) duration="${2:?}"; shift 2 ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "local.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

bash scripts/bootstrap.sh
py="$root/.venv/bin/python"
work="$(mktemp -d "${TMPDIR:-/tmp}/scheduled-events-local.XXXXXX")"
pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "$keep" -eq 1 ]; then echo "local.sh: kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -z "$duration" ]; then
  # The last step, plus the longest notice (Terminate, 15 min) and a Started event's lifetime, in scaled seconds.
  duration="$("$py" -c '
import sys
from emulators.imds import Scenario
scenario = Scenario.from_file(sys.argv[1])
last = max((step.at for step in scenario.steps), default=0)
print(int((last + 900 + 600) / float(sys.argv[2])) + 5)
' "$scenario" "$time_scale")"
fi

"$py" -m emulators.imds --port 0 --scenario "$scenario" --time-scale "$time_scale" >"$work/imds.json" 2>"$work/imds.log" &
pids+=("$!")
for _ in $(seq 100); do [ -s "$work/imds.json" ] && break; sleep 0.1; done
[ -s "$work/imds.json" ] || { echo "local.sh: the IMDS emulator did not start:" >&2; cat "$work/imds.log" >&2; exit 1; }

# A demo prepare/recover hook, so that hook reports show up in the timeline.
mkdir -p "$work/hooks/prepare.d" "$work/hooks/recover.d"
printf '#!/bin/sh\necho "%s $VM_NAME for $SCHEDULED_EVENT_TYPE $SCHEDULED_EVENT_ID"\n' draining >"$work/hooks/prepare.d/10-drain"
printf '#!/bin/sh\necho "%s $VM_NAME after $SCHEDULED_EVENT_TYPE"\n' restoring >"$work/hooks/recover.d/10-restore"
chmod +x "$work/hooks/prepare.d/10-drain" "$work/hooks/recover.d/10-restore"

vms="$("$py" -c 'import json,sys; [print(n, u) for n, u in json.load(open(sys.argv[1]))["vms"].items()]' "$work/imds.json")"
while read -r name url; do
  SE_FORWARDER_IMDS_URL="$url" SE_FORWARDER_SINK=jsonl SE_FORWARDER_JSONL_PATH="$work/$name.jsonl" \
  SE_FORWARDER_STATE_DIR="$work/state-$name" SE_FORWARDER_HOOKS_DIR="$work/hooks" \
    "$py" -m forwarder run 2>"$work/$name.log" &
  pids+=("$!")
done <<<"$vms"
echo "local.sh: $(wc -l <<<"$vms") forwarders on $scenario at time scale $time_scale for ${duration}s; files in $work" >&2

# The timeline: every envelope any forwarder wrote, as one line each, until the duration is over.
"$py" -u - "$work" "$duration" <<'PY'
import json, sys, time
from pathlib import Path


def line(e: dict) -> str:
    head = f"{e['observedAt'][11:19]} {e['vm']['name']:<13} #{e['sequence']:<3} {e['kind']:<11}"
    if e["kind"] == "incarnation":
        d = e["document"]
        events = ", ".join(
            f"{x['EventType']}/{x['EventStatus']}/{x['EventId'][:8]}->{'+'.join(x['Resources'])}" for x in d["Events"]
        )
        return f"{head} incarnation {d['DocumentIncarnation']}: {events or '(none)'}"
    if e["kind"] == "hook":
        h = e["hook"]
        return f"{head} {h['phase']} {h['eventId'][:8]} {h['outcome']}: {h['outputTail'].strip()[:60]}"
    return f"{head} polls={e.get('counters', {}).get('polls')}"


work, deadline = Path(sys.argv[1]), time.monotonic() + float(sys.argv[2])
offsets: dict[Path, int] = {}
try:
    while time.monotonic() < deadline:
        for path in sorted(work.glob("*.jsonl")):
            with path.open("rb") as f:
                f.seek(offsets.get(path, 0))
                for raw in iter(f.readline, b""):
                    if not raw.endswith(b"\n"):
                        break  # a line still being written: read it next round
                    offsets[path] = f.tell()
                    print(line(json.loads(raw)))
        time.sleep(0.25)
except KeyboardInterrupt:  # Ctrl-C: the shell's trap stops everything
    pass
PY
echo "local.sh: done (scenario time is over)" >&2
