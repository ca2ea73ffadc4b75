"""Local health pages for a policy's HTTP gates, whose behaviour a scenario changes while it plays.

A policy run locally names a gate's page ``http://local-gates/{name}`` (a gate read for one VM:
``http://local-gates/{name}/{vm}``, each VM's page answering as its gate until a step sets ``{name}/{vm}``); the
stack serves every such gate from one ``GateServer`` on 127.0.0.1 and hands the coordinator a copy of the policy
with those URLs pointing at it (``rewrite_policy``). Each page answers as its current behaviour says
(``emulators.imds.models.GateStep``): passing (200), failing (503), slow (200 after a delay), trickle (200 at once,
the body a byte at a time), dead (accepted, never answered). Every change is logged with its wall-clock time: what
an oracle needs to know which answers a gate gave when.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from emulators.imds.local_steps import GateBehaviour
from emulators.served import close, serve_local

LOCAL_GATES = "http://local-gates/"
_LOCAL_GATE_URL = re.compile(r"http://local-gates/([A-Za-z0-9_.-]+)")
# A trickled body: this many bytes spread over the behaviour's delay.
TRICKLE_BYTES = 16


def local_gate_names(policy_text: str) -> list[str]:
    """The gates a policy serves locally (``http://local-gates/{name}`` URLs), in order of appearance."""
    return list(dict.fromkeys(_LOCAL_GATE_URL.findall(policy_text)))


@dataclass(frozen=True)
class GateChange:
    at: datetime
    name: str
    behaviour: GateBehaviour
    delay_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "name": self.name,
            "state": self.behaviour,
            "delaySeconds": self.delay_seconds,
        }


class GateServer:
    """One page per gate name, each passing until told otherwise (``set``)."""

    def __init__(self, names: list[str]) -> None:
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.behaviour: dict[str, tuple[GateBehaviour, float]] = dict.fromkeys(names, ("passing", 0.0))
        started = datetime.now(UTC)
        self.log: list[GateChange] = [GateChange(started, name, "passing", 0.0) for name in names]
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> int:
        self._server = serve_local(_Page, name="gates", gates=self)
        return self.port

    def stop(self) -> None:
        self._stopping.set()  # releases the dead and slow pages' requests
        close(self._server)
        self._server = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the gate server is not started")
        return int(self._server.server_address[1])

    def rewrite_policy(self, policy_text: str) -> str:
        return policy_text.replace(LOCAL_GATES, f"http://127.0.0.1:{self.port}/")

    def set(self, name: str, behaviour: GateBehaviour, delay_seconds: float = 0.0) -> None:
        with self._lock:
            self.behaviour[name] = (behaviour, delay_seconds)
            self.log.append(GateChange(datetime.now(UTC), name, behaviour, delay_seconds))

    def answer(self, name: str) -> tuple[GateBehaviour, float] | None:
        """The page ``name`` as set; a gate read for one VM (``http://local-gates/ready/{vm}``: ``ready/web_0``)
        answers as set for that VM, else as its gate (``ready``)."""
        with self._lock:
            return self.behaviour.get(name) or self.behaviour.get(name.split("/", 1)[0])

    def wait(self, seconds: float) -> bool:
        """Sleeps ``seconds`` unless the server stops first (True then)."""
        return self._stopping.wait(seconds)


class _Page(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        gates: GateServer = self.server.gates  # type: ignore[attr-defined]
        answer = gates.answer(self.path.strip("/"))
        if answer is None:
            self._reply(404, b"no such gate")
            return
        behaviour, delay = answer
        if behaviour == "dead":
            gates.wait(3600)
            self.close_connection = True
            return
        if behaviour == "slow" and gates.wait(delay):
            return
        if behaviour == "failing":
            self._reply(503, b"failing")
            return
        if behaviour != "trickle":
            self._reply(200, b"ok")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(TRICKLE_BYTES))
        self.end_headers()
        self.wfile.flush()
        started = time.monotonic()
        for index in range(TRICKLE_BYTES):
            if gates.wait(max(0.0, started + delay * (index + 1) / TRICKLE_BYTES - time.monotonic())):
                return
            self.wfile.write(b".")
            self.wfile.flush()

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return
