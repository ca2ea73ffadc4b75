"""``pip install ".[ops]"`` gives the operator tools as commands (pyproject.toml ``[project.scripts]``): the package is
built from a copy of what a clone tracks and installed into a fresh virtual environment, then each command runs from
outside the clone, so what answers is the installed package (its modules and data files), never the checkout.

The build is offline: no build isolation and ``--no-deps`` (this test's own environment lends the dependencies,
through a ``.pth`` file), so that what is checked is the packaging itself; the dependencies it declares are read
back from the installed metadata and held to the files that pin them."""

from __future__ import annotations

import shutil
import socket
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from coordinator import SqliteHistory

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("sefleet-policy", "sefleet-history", "sefleet-cost", "sefleet-drill")
SS = (
    "/subscriptions/00000000-0000-0000-0000-00000000e001/resourceGroups/rg/providers/"
    "Microsoft.Compute/virtualMachineScaleSets/web"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the package installed from a copy of the clone; its bin directory."""
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "requirements.txt"):
        shutil.copy(ROOT / name, source / name)
    for package in ("ops", "coordinator", "contracts"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "lent-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--no-build-isolation", "--no-index", str(source)],
        check=True, cwd=base, timeout=240,
    )  # fmt: skip
    return venv / "bin"


def command(
    bin_dir: Path, name: str, *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / name), *args], capture_output=True, text=True, cwd=cwd, timeout=120, env=env, check=False
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_tool_is_a_command_of_the_installed_package_with_its_data(installed: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in installed.glob("sefleet-*")) == sorted(COMMANDS)
    where = subprocess.run(
        [str(installed / "python"), "-c", "import ops, coordinator; print(ops.__file__); print(coordinator.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    ).stdout.split()  # fmt: skip
    assert all(str(installed.parent) in path for path in where), where

    shipped = installed.parent.glob("lib/python*/site-packages/coordinator/policies/default.yaml")
    (policy,) = list(shipped)
    checked = command(installed, "sefleet-policy", "check", str(policy), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "valid, 4 rules" in checked.stdout
    tested = command(installed, "sefleet-policy", "test", str(policy), cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert " 0 failed, 0 errors" in tested.stdout

    database = tmp_path / "history.sqlite"
    SqliteHistory(database)
    counted = command(installed, "sefleet-history", "--db", str(database), "kql", "ScheduledEventsHistory_CL | count",
                      cwd=tmp_path)  # fmt: skip
    assert counted.returncode == 0, counted.stderr
    assert "0" in counted.stdout.split()
    usage = command(installed, "sefleet-history", "--help", cwd=tmp_path)
    assert usage.stdout.startswith("usage: sefleet-history ")
    assert '"source": "assumed rates"' in command(installed, "sefleet-cost", cwd=tmp_path).stdout
    with sqlite3.connect(database) as db:
        assert db.execute("select count(*) from ScheduledEventsHistory_CL").fetchone() == (0,)


def test_without_azure_credentials_the_drill_says_what_to_do_in_one_line(installed: Path, tmp_path: Path) -> None:
    """No sign-in, no managed identity (pointed at a closed local port: never IMDS), no Azure CLI on the PATH."""
    env = {
        "PATH": str(installed),
        "HOME": str(tmp_path),
        "AZURE_POD_IDENTITY_AUTHORITY_HOST": f"http://127.0.0.1:{closed_port()}",
    }
    drilled = command(installed, "sefleet-drill", "reboot", "--vm", "web_0", "--scale-set", SS, "--endpoint",
                      f"http://127.0.0.1:{closed_port()}", cwd=tmp_path, env=env)  # fmt: skip
    assert drilled.returncode == 2
    (line,) = drilled.stderr.strip().splitlines()
    assert line.startswith("error: no Azure credential: ")
    assert "az login" in line


def test_the_declared_dependencies_are_the_pinned_files(installed: Path, tmp_path: Path) -> None:
    """What ``pip install ".[ops]"`` resolves is what requirements.txt and ops/requirements.txt pin."""

    def pinned(path: Path) -> set[str]:
        lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
        return {line for line in lines if line and not line.startswith("-")}

    read = "import importlib.metadata as m; print('\\n'.join(m.requires('scheduled-events-fleet')))"
    out = subprocess.run([str(installed / "python"), "-c", read], capture_output=True, text=True, cwd=tmp_path,
                         check=True).stdout  # fmt: skip
    declared = {Requirement(line) for line in out.splitlines()}
    expected = {Requirement(r) for r in pinned(ROOT / "requirements.txt")} | {
        Requirement(f'{r}; extra == "ops"') for r in pinned(ROOT / "ops" / "requirements.txt")
    }
    assert {str(r) for r in declared} == {str(r) for r in expected}
    assert any(r.name == "duckdb-kql" for r in declared)
