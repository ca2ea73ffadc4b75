#!/usr/bin/env bash
# Interleaved A/B of the wave (10k VMs, bindings warm) and the approval path (1,000 approvals) between two commits,
# each round running A then B, so that a noisy machine weighs on both alike:
#   bash scripts/ab-bench.sh BASE [HEAD] [ROUNDS]     (HEAD defaults to HEAD, ROUNDS to 3)
# Prints one line per run: the side, wave_seconds, the coordinator's CPU seconds, approval_ms_p50 and p99. Each side
# runs from a detached worktree under .local/ab/ sharing this checkout's .venv and tools (run scripts/bootstrap.sh
# first); the worktrees are removed at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base=$(git -C "$root" rev-parse "${1:?usage: ab-bench.sh BASE [HEAD] [ROUNDS]}")
head=$(git -C "$root" rev-parse "${2:-HEAD}")
rounds=${3:-3}
mkdir -p "$root/.local/ab"
cleanup() { for side in base head; do git -C "$root" worktree remove --force "$root/.local/ab/$side" 2>/dev/null || true; done; }
trap cleanup EXIT
for side in base head; do
  commit=$base; [ "$side" = head ] && commit=$head
  git -C "$root" worktree add --quiet --force --detach "$root/.local/ab/$side" "$commit" >/dev/null
  ln -sfn "$root/.venv" "$root/.local/ab/$side/.venv"
  ln -sfn "$root/tools/node/node_modules" "$root/.local/ab/$side/tools/node/node_modules"
done
figure() { python3 -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(' '.join(str(d.get(k)) for k in sys.argv[1:]))" "$@"; }
for round in $(seq 1 "$rounds"); do
  for side in base head; do
    cd "$root/.local/ab/$side"
    wave=$(.venv/bin/python -m benchmarks.wave 2>/dev/null | figure wave_seconds coordinator_cpu_seconds)
    approval=$(.venv/bin/python -m benchmarks.approval_latency --n 1000 2>/dev/null | figure approval_ms_p50 approval_ms_p99)
    echo "round $round $side $(git rev-parse --short HEAD) wave_seconds/cpu $wave approval_ms_p50/p99 $approval"
  done
done
