"""The docs quote figures the code computes: each quoted figure is compared with what the code says now."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cost(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "ops.cost", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module")
def relay() -> dict[str, float]:
    """Dollars per VM-month of the Relay listener at the model's default rates, as ``python -m ops.cost`` says."""
    exact, whole_hours = cost(), cost("--round-up-hours")
    return {
        "on_demand": exact["on_demand"]["usd_per_vm_month"],
        "whole_hours": whole_hours["on_demand"]["usd_per_vm_month"],
        "always_on": exact["always_on"]["usd_per_vm_month"],
    }


def test_the_deploy_pages_cost_table_quotes_the_relay_cost_the_cost_tool_computes(relay: dict[str, float]) -> None:
    row = next(line for line in (ROOT / "docs" / "deploy.md").read_text().splitlines() if "Azure Relay Hybrid" in line)
    figure = row.split("|")[2]
    assert f"{relay['on_demand']:.3f} per VM" in figure
    assert f"{relay['whole_hours']:.3f} if every connection is billed as a whole hour" in figure
    assert f"{relay['always_on']:.2f} always on" in figure
    assert "largest" not in row


def test_the_readmes_deployment_cost_quotes_the_relay_cost_the_cost_tool_computes(relay: dict[str, float]) -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Azure Relay ≈ ${relay['on_demand']:.3f} per VM" in readme
    assert f"(${relay['whole_hours']:.3f} if every connection is billed as a whole hour;" in readme
    assert f"always-on would be ${relay['always_on']:.2f} per VM" in readme
