"""The daemon's relay seam, end to end on loopback: with relay settings on, the forwarder runs the relay listener on
its own hybrid connection (VmIdentity.hybrid_connection_name) with the VM's managed identity — on demand (the
default: connected only while its IMDS document holds a Scheduled event it could approve, plus a grace period) or
always on. An approval sent by the coordinator's sender through the Relay emulator reaches IMDS, and the forwarder
then forwards the event as Started. Stopping the forwarder closes the listener."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AzureNamedKeyCredential

from contracts import wire
from contracts.approval import ApprovalRequest
from contracts.envelope import VmIdentity
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from forwarder import cli
from forwarder.cli import relay_companions
from forwarder.config import ForwarderSettings, load_settings
from forwarder.imds import ImdsClient, ImdsError
from forwarder.on_demand import OnDemandListener
from tests.forwarder.conftest import Harness, forwarder_importing, write_hook
from tests.polling import wait_for
from tests.relay.conftest import facts_of

SEND_KEY = "c2VuZC1rZXktZm9yLWZvcndhcmRlci10ZXN0cw=="


@pytest.fixture
def relay() -> Iterator[RelayEmulator]:
    emulator = RelayEmulator(sas_keys={"send": SEND_KEY}, response_timeout=5.0)
    emulator.start()
    yield emulator
    emulator.stop()


def _settings(imds: ImdsEmulator, relay: RelayEmulator, vm: str = "web_0", **flags: object) -> ForwarderSettings:
    endpoint = relay.ws_url
    return load_settings(
        flags={"sink": "stdout", "relay_enabled": True, "relay_endpoint": endpoint, "imds_url": imds.url_for(vm)}
        | flags,
        environ={},
    )


def _web_0(
    harness: Callable[..., Harness],
    imds: ImdsEmulator,
    relay: RelayEmulator,
    *,
    heartbeat_interval: float | None = None,
    **flags: Any,
) -> tuple[Harness, wire.VmIdentity, str]:
    """web_0's forwarder started with the relay companions of ``_settings(imds, relay, **flags)`` (a heartbeat every
    ``heartbeat_interval`` s, else the harness's), the identity it read, and its hybrid connection's name."""
    settings = _settings(imds, relay, **flags)
    every = {} if heartbeat_interval is None else {"heartbeat_interval": heartbeat_interval}
    h = harness(settings.imds_url, companions=relay_companions(settings), **every)
    identity = h.forwarder.identity
    assert identity is not None
    return h, identity, identity.hybrid_connection_name


def _request(created: dict[str, object]) -> ApprovalRequest:
    now = datetime.now(UTC)
    return ApprovalRequest(
        eventId=str(created["EventId"]),
        decisionId=uuid.uuid4().hex,
        rule="test",
        issuedAt=now,
        expiresAt=now + timedelta(minutes=5),
        notAfter=now + timedelta(minutes=5),
        facts=facts_of(created),
    )


def test_on_demand_listener_connects_for_an_event_and_leaves_after_the_grace(
    imds: ImdsEmulator, relay: RelayEmulator, harness: Callable[..., Harness]
) -> None:
    h, identity, hc = _web_0(harness, imds, relay, heartbeat_interval=0.2, relay_listener_grace_seconds=1.0)
    # No event: no listener, and the heartbeats say so.
    wait_for(lambda: len(h.envelopes("heartbeat")) >= 3, what="three heartbeats")
    assert relay.listener_count(hc) == 0
    # (The first one goes out before the companions are built, so it cannot know; see Forwarder.run.)
    assert all(b["health"].get("listenerConnected") is False for b in h.envelopes("heartbeat")[1:])

    created = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(2)
    # The sender is called as soon as the forwarder has seen the event: it waits out the listener's connect.
    with RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY)) as sender:
        result = sender.send(_request(created), vm=VmIdentity.of(identity))
    assert result.outcome == "approved"
    assert [a["EventId"] for a in imds.approvals()] == [created["EventId"]]
    wait_for(
        lambda: any(b["health"].get("listenerConnected") is True for b in h.envelopes("heartbeat")),
        what="a heartbeat with the listener connected",
    )
    started = h.wait_incarnation(3)
    assert started["document"]["Events"][0]["EventStatus"] == "Started"
    # Started: nothing left to approve; the listener stays for the grace period, then leaves.
    left = wait_for(lambda: relay.listener_count(hc) == 0, what="the listener to leave")
    assert left
    wait_for(
        lambda: h.envelopes("heartbeat")[-1]["health"].get("listenerConnected") is False,
        what="a heartbeat with the listener disconnected",
    )
    h.stop()


def test_a_force_request_runs_the_vms_own_hook_from_its_hooks_folder_then_starts_the_event(
    imds: ImdsEmulator, relay: RelayEmulator, harness: Callable[..., Harness]
) -> None:
    """The daemon gives the listener its force hooks: the forwarder's hooks folder, its runner, its spool. The answer
    is "accepted"; the hook's phase goes out as a hook envelope, and StartRequests follows it."""
    h, identity, _ = _web_0(harness, imds, relay)
    ran = h.root / "drain-ran"
    write_hook(h.settings.hooks_dir / "force.d", "drain", f'echo "$SCHEDULED_EVENT_PHASE" > "{ran}"\nsleep 0.5\n')
    created = imds.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(2)
    request = _request(created)
    assert request.facts is not None
    forced = request.model_copy(update={"facts": request.facts.model_copy(update={"forceHook": "drain"})})
    with RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY)) as sender:
        result = sender.send(forced, vm=VmIdentity.of(identity))
    assert (result.outcome, imds.approvals()) == ("accepted", [])
    wait_for(imds.approvals, what="StartRequests after the hook")
    assert ran.read_text() == "force\n"
    assert [a["EventId"] for a in imds.approvals()] == [created["EventId"]]
    force = wait_for(lambda: [e["hook"] for e in h.envelopes("hook") if e["hook"]["phase"] == "force"], what="report")
    assert [(r["outcome"], [s["hook"] for s in r["steps"]]) for r in force] == [("succeeded", ["drain"])]
    h.stop()


def test_on_demand_listener_stays_for_the_grace_period(
    imds: ImdsEmulator, relay: RelayEmulator, harness: Callable[..., Harness]
) -> None:
    h, _, hc = _web_0(harness, imds, relay, relay_listener_grace_seconds=3.0)
    created = imds.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)
    wait_for(lambda: relay.listener_count(hc) == 1, what="the listener to connect")
    imds.cancel_event(str(created["EventId"]))
    h.wait_incarnation(3)
    gone_at = time.monotonic()
    wait_for(lambda: relay.listener_count(hc) == 0, what="the listener to leave")
    # It left after the grace period (the poll is 0.05 s here), not at once.
    assert time.monotonic() - gone_at >= 2.5
    h.stop()


def test_on_demand_listener_ignores_a_peers_terminate_but_connects_for_its_group(
    imds: ImdsEmulator, relay: RelayEmulator, harness: Callable[..., Harness]
) -> None:
    h, _, hc = _web_0(harness, imds, relay, relay_listener_grace_seconds=0.0)
    imds.create_event(EventType="Terminate", Resources=["web_1"], NoticeSeconds=900)
    document = h.wait_incarnation(2)["document"]
    assert [e["Resources"] for e in document["Events"]] == [["web_1"]]  # web_0 sees its peer's delete
    time.sleep(1.0)  # twenty polls
    assert relay.listener_count(hc) == 0
    # A Freeze of the group (another VM's) is one this VM may approve: the listener connects.
    imds.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)
    wait_for(lambda: relay.listener_count(hc) == 1, what="the listener to connect")
    h.stop()
    wait_for(lambda: relay.listener_count(hc) == 0, what="the listener to close")


def test_always_on_listener_stays_connected(
    imds: ImdsEmulator, relay: RelayEmulator, harness: Callable[..., Harness]
) -> None:
    h, _, hc = _web_0(harness, imds, relay, heartbeat_interval=0.2, relay_listener_mode="always-on")
    wait_for(lambda: relay.listener_count(hc) == 1, what="the listener to connect")
    wait_for(
        lambda: any(b["health"].get("listenerConnected") is True for b in h.envelopes("heartbeat")),
        what="a heartbeat with the listener connected",
    )
    time.sleep(1.0)  # no event at all: it stays
    assert relay.listener_count(hc) == 1

    relay.stop()  # the control channel drops; the heartbeats say so
    wait_for(
        lambda: h.envelopes("heartbeat")[-1]["health"].get("listenerConnected") is False,
        what="a heartbeat with the listener disconnected",
    )
    relay.start()
    h.stop()
    wait_for(lambda: relay.listener_count(hc) == 0, what="the listener to close")


def test_an_idle_forwarder_loads_its_listener_at_start_and_connects_only_for_an_event(
    imds: ImdsEmulator, relay: RelayEmulator, tmp_path: Path
) -> None:
    """On demand, an idle forwarder (relay on, no event) loads its listener and WebSocket client in the background at
    start (`-X importtime` of a real `python -m forwarder run`), so that an event's session does not import them while
    its approval races the connect, but connects only when an event it could approve appears."""
    relay_on = {
        "SE_FORWARDER_RELAY_ENABLED": "true",
        "SE_FORWARDER_RELAY_ENDPOINT": relay.ws_url,
    }
    listener_modules = (
        "forwarder.relay_listener",
        "forwarder.relay_protocol",
        "forwarder.relay_tokens",
        "forwarder.websocket",
    )
    with forwarder_importing(imds, tmp_path, **relay_on) as log:
        wait_for(
            lambda: all(m in log.read_text(encoding="utf-8") for m in listener_modules), what="the warm-up's imports"
        )
        time.sleep(1.0)  # ten more polls, idle
        assert relay.listener_count(_hc(imds)) == 0  # loaded, not connected: no listener-hours billed while idle
        imds.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)
        wait_for(lambda: relay.listener_count(_hc(imds)) == 1, what="the listener to connect")
    assert "websockets" not in log.read_text(encoding="utf-8")  # the package: the listener has its own small client


def _hc(imds: ImdsEmulator) -> str:
    client = ImdsClient(base_url=imds.url_for("web_0"))
    try:
        return client.get_identity().hybrid_connection_name
    finally:
        client.close()


class _IdleSession:
    connected = False

    def start(self) -> _IdleSession:
        return self

    def stop(self) -> None:
        return None


def test_on_demand_listener_warms_up_once_at_start_and_a_failed_warm_up_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Relay token is fetched at start (cached by the credential), so the first session opened for an event
    does not take an IMDS token call from the rate limiter while its approval waits."""
    calls: list[str] = []
    listener = OnDemandListener(factory=_IdleSession, vm_name="web_0", warm=lambda: calls.append("token"))
    listener.start()
    wait_for(lambda: calls == ["token"], what="the warm-up")
    assert listener.sessions == 0  # warming up opens no session: no listener-hours are billed for it
    listener.stop()

    def failing() -> None:
        raise OSError("IMDS token endpoint unreachable")

    with caplog.at_level("WARNING", logger="forwarder.listener"):
        broken = OnDemandListener(factory=_IdleSession, vm_name="web_0", warm=failing).start()
        wait_for(lambda: "warm-up failed" in caplog.text, what="the warning")
    broken.update(None)  # still works
    broken.stop()


def test_a_warm_up_that_gets_no_token_still_loads_the_sessions_parts(
    imds: ImdsEmulator, relay: RelayEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts need no IMDS: an IMDS that cannot give a token at start (down, throttling) leaves them loaded, and
    the first session opened for an event pays only for its token."""

    class NoToken:
        def get_token(self, *scopes: str, **kwargs: Any) -> Any:
            raise ImdsError("IMDS answered 503")

    monkeypatch.setattr(cli, "build_credential", lambda settings, imds: NoToken())
    client = ImdsClient(base_url=imds.url_for("web_0"))
    try:
        sessions = cli._Sessions(
            _settings(imds, relay), client.get_identity(), client, store=None, telemetry=None, force=None
        )
        with pytest.raises(ImdsError):
            sessions.warm()
        made = sessions._made
        assert made is not None
        assert sessions.session() is not None
        assert sessions._made is made  # made once, by the warm-up
    finally:
        client.close()
