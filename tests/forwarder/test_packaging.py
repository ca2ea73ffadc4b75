"""The systemd unit (systemd-analyze verify when present, and the hardening keys) and install.sh (into a scratch
root; the settings file it writes must load)."""

from __future__ import annotations

import configparser
import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from forwarder.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "forwarder" / "systemd" / "scheduled-events-forwarder.service"
LOCK = ROOT / "forwarder" / "requirements.lock"


def unit_entries() -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.setdefault(f"{section}.{key}", []).append(value)
    return entries


def test_unit_has_the_hardening_keys() -> None:
    entries = unit_entries()
    expected = {
        "Service.User": ["se-forwarder"],
        "Service.NoNewPrivileges": ["yes"],
        "Service.ProtectSystem": ["strict"],
        "Service.ProtectHome": ["yes"],
        "Service.PrivateTmp": ["yes"],
        "Service.StateDirectory": ["scheduled-events-forwarder"],
        "Service.CapabilityBoundingSet": [""],
        "Service.RestrictAddressFamilies": ["AF_INET AF_INET6 AF_UNIX"],
        "Service.KillMode": ["mixed"],
    }
    for key, value in expected.items():
        assert entries.get(key) == value, key
    assert entries["Service.ExecStart"][0].endswith("-m forwarder run --config /etc/scheduled-events/forwarder.yaml")
    # The unit's state directory is the forwarder's default state_dir: no path to keep in step by hand.
    default_state = load_settings(flags={"sink": "stdout"}, environ={}).state_dir
    assert default_state == Path("/var/lib") / entries["Service.StateDirectory"][0]
    configparser.ConfigParser(strict=False).read_string(UNIT.read_text())  # plain INI syntax


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    # verify insists that ExecStart's binary exists; point it at this Python, change nothing else.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/scheduled-events-forwarder/venv/bin/python", sys.executable))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""  # a misspelt or invalid key is only a warning: none allowed
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True, check=False
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    assert match, security.stdout[-500:]
    assert float(match.group(1)) <= 2.0  # "OK" on systemd's 0-10 scale


def test_install_into_a_scratch_root(tmp_path: Path) -> None:
    args = ["bash", str(ROOT / "forwarder" / "install.sh"), "--root", str(tmp_path), "--skip-venv"]
    run = [*args, "--eventhub-namespace", "ns1.servicebus.windows.net", "--client-id", "1111-2222"]
    subprocess.run([*run, "--relay-namespace", "relay1.servicebus.windows.net"], check=True, capture_output=True)
    config = tmp_path / "etc/scheduled-events/forwarder.yaml"
    settings = load_settings(config_file=config, environ={})
    assert settings.eventhub_namespace == "ns1.servicebus.windows.net"
    assert settings.managed_identity_client_id == "1111-2222"
    assert settings.relay_enabled is True
    assert (tmp_path / "etc/systemd/system" / UNIT.name).read_text() == UNIT.read_text()
    assert (tmp_path / "etc/scheduled-events/hooks/prepare.d").is_dir()
    assert (tmp_path / "opt/scheduled-events-forwarder/app/forwarder/daemon.py").is_file()
    installed_lock = tmp_path / "opt/scheduled-events-forwarder/app/forwarder/requirements.lock"
    assert installed_lock.read_text() == LOCK.read_text()
    # Again: the settings an operator edited are kept.
    config.write_text(config.read_text() + "poll_interval: 2\n")
    subprocess.run(args, check=True, capture_output=True)
    assert load_settings(config_file=config, environ={}).poll_interval == 2


def test_the_installed_forwarder_starts_without_compiling_a_module(tmp_path: Path) -> None:
    """The unit runs with PYTHONDONTWRITEBYTECODE=1 on a read-only /opt: install.sh leaves byte code that stays
    valid, so a start compiles nothing (compiling the generated validators at each start cost 6.5 MiB of RSS)."""
    subprocess.run(
        ["bash", str(ROOT / "forwarder" / "install.sh"), "--root", str(tmp_path), "--skip-venv",
         "--eventhub-namespace", "ns1.servicebus.windows.net"],
        check=True, capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )  # fmt: skip
    app = tmp_path / "opt" / "scheduled-events-forwarder" / "app"
    # A later copy of the tree with other file times (an image rebuilt) must not make the byte code stale.
    for source in app.rglob("*.py"):
        source.touch()
    code = (
        "import importlib.machinery as m, sys\n"
        "compiled = []\n"
        "original = m.SourceFileLoader.source_to_code\n"
        "def counted(self, data, path, **kw):\n"
        "    compiled.append(path)\n"
        "    return original(self, data, path, **kw)\n"
        "m.SourceFileLoader.source_to_code = counted\n"
        "import forwarder.cli, forwarder.daemon, forwarder.relay_listener, contracts.wire\n"
        "print([p for p in compiled if p.startswith(sys.argv[1])])\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(app)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(app)], capture_output=True, text=True, check=True, env=env, cwd=tmp_path
    )
    assert done.stdout.strip() == "[]"


def test_install_refuses_a_first_install_without_a_target(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "forwarder" / "install.sh"), "--root", str(tmp_path), "--skip-venv"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "--eventhub-namespace is required" in result.stderr


def _locked() -> dict[str, tuple[Version, list[str]]]:
    """The lock's pins: name -> (version, hashes), one entry per requirement (continuation lines joined)."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    text = LOCK.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        spec, *options = line.split(" --hash=")
        requirement = Requirement(spec.strip())
        pins = [s for s in requirement.specifier if s.operator == "=="]
        assert len(pins) == 1, f"{line[:80]}: not pinned to one version"
        hashes = [option.strip() for option in options]
        entries[canonicalize_name(requirement.name)] = (Version(pins[0].version), hashes)
    return entries


def test_the_lock_pins_every_requirement_with_hashes() -> None:
    """VMs install forwarder/requirements.lock with --require-hashes: it must satisfy requirements.txt, and pip
    refuses the whole install if any line lacks a hash (refresh: bash scripts/lock-forwarder.sh)."""
    locked = _locked()
    for line in (ROOT / "forwarder" / "requirements.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        wanted = Requirement(line)
        name = canonicalize_name(wanted.name)
        assert name in locked, f"{wanted.name} is not in the lock"
        assert locked[name][0] in wanted.specifier, f"lock pins {name} {locked[name][0]}, outside {wanted.specifier}"
    for pinned, (_version, hashes) in locked.items():
        assert hashes, f"{pinned} has no hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), pinned
    install = (ROOT / "forwarder" / "install.sh").read_text()
    assert "--require-hashes --no-deps" in install
    assert '-r "$opt/app/forwarder/requirements.lock"' in install


@pytest.mark.slow
def test_the_package_installs_without_an_index_and_runs(tmp_path: Path) -> None:
    """The built package carries its wheels: install.sh makes the venv with `pip --no-index --require-hashes`
    (no package index at all), and the installed forwarder runs: `--help`, and `once` against the IMDS emulator.
    Built here for this interpreter; the deployment's package is built for the VM image's (Python 3.12, x86_64)."""
    from emulators.imds import ImdsEmulator

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "package-forwarder.sh"), str(tmp_path / "out"), "--python", version,
         "--arch", platform.machine()],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    package = Path(built.stdout.split()[1])
    unpacked = tmp_path / "package"
    unpacked.mkdir()
    with tarfile.open(package) as archive:
        archive.extractall(unpacked, filter="data")
    wheels = sorted(p.name for p in (unpacked / "forwarder" / "wheels").iterdir())
    dependencies = {"h11", "pyyaml", "wsproto"}
    assert {name.split("-")[0].lower() for name in wheels} == dependencies
    scratch = tmp_path / "root"
    # No index anywhere: a configured index or proxy cannot be what makes the install work.
    offline = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": sys.executable,
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_NO_INDEX": "1",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    subprocess.run(
        ["bash", str(unpacked / "forwarder" / "install.sh"), "--root", str(scratch),
         "--eventhub-namespace", "ns1.servicebus.windows.net"],
        capture_output=True, text=True, check=True, env=offline, timeout=300,
    )  # fmt: skip
    opt = scratch / "opt" / "scheduled-events-forwarder"
    installed = subprocess.run(
        [str(opt / "venv" / "bin" / "python"), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        capture_output=True, text=True, check=True, env=offline,
    )  # fmt: skip
    names = {canonicalize_name(line.split("==")[0]) for line in installed.stdout.splitlines()} - {"pip", "setuptools"}
    assert names == {canonicalize_name(name) for name in dependencies}
    # As the unit runs it: the venv's Python, the app on PYTHONPATH, nothing from this checkout.
    unit_env = {**offline, "PYTHONPATH": str(opt / "app")}
    python = str(opt / "venv" / "bin" / "python")
    help_text = subprocess.run(
        [python, "-m", "forwarder", "run", "--help"], capture_output=True, text=True, check=True, env=unit_env, cwd=opt
    )
    assert "--eventhub-namespace" in help_text.stdout
    with ImdsEmulator() as imds:
        once = subprocess.run(
            [python, "-m", "forwarder", "once", "--imds-url", imds.url_for(imds.first_vm)],
            capture_output=True, text=True, check=True, env=unit_env, cwd=opt, timeout=60,
        )  # fmt: skip
    assert json.loads(once.stdout)["identity"]["name"] == imds.first_vm
