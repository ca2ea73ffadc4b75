"""A benchmark module for tests of ``python -m benchmarks``'s own rules: prints what its arguments say.

python -m tests.benchmarks.fake_bench valid|invalid|silent|crash|no-verdict|valid-then-invalid:FILE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.checks import scratch

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("valid-then-invalid:"):  # valid once, then invalid: the file named remembers the first run
        seen = Path(mode.split(":", 1)[1])
        mode = "invalid" if seen.exists() else "valid"
        seen.touch()
    with scratch() as work:  # what a run leaves, kept when it is invalid
        (work / "stack.log").write_text(f"the fake benchmark's {mode} run", encoding="utf-8")
    if mode == "invalid":
        print(f"the fake benchmark runs {mode}", file=sys.stderr)
    if mode == "crash":
        raise SystemExit("the fake benchmark crashed as asked")
    result: dict[str, object] = {"seconds": 1.5, "wave_envelopes": 1000}
    if mode != "no-verdict":
        result["problems"] = ["accepted 0 of 1000 envelopes"] if mode == "invalid" else []
    if mode != "silent":
        print(json.dumps(result))
    sys.exit(1 if mode == "invalid" else 0)
