"""The local-only DirectImdsCallback judges as a VM's listener does (forwarder.approval_rules.judge), then approves."""

from __future__ import annotations

from datetime import timedelta

from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.document import ScheduledEventsDocument
from contracts.envelope import VmIdentity
from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.clock import ManualClock
from local.direct_callback import DirectImdsCallback
from tests.coordinator.helpers import DOC_NOW, vm


def _request(facts: ApprovalFacts, event_id: str, decision: str) -> ApprovalRequest:
    return ApprovalRequest(
        eventId=event_id,
        decisionId=decision,
        rule="r",
        issuedAt=DOC_NOW,
        expiresAt=DOC_NOW + timedelta(minutes=15),
        facts=facts,
    )


def test_it_refuses_what_the_vms_own_imds_and_ledger_do_not_show_and_approves_what_they_do():
    scenario = Scenario.model_validate({"name": "direct", "vms": [{"name": "web_0", "vmScaleSetName": "web"}]})
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=ManualClock(DOC_NOW)) as imds:
        event_id = imds.create_event(EventType="Terminate", Resources=["web_0"], NoticeSeconds=900)["EventId"]
        document = ScheduledEventsDocument.model_validate(imds.document("web_0"))
        event = document.event(event_id)
        assert event is not None
        target = VmIdentity.model_validate(vm("web_0", scale_set="web", index=1))
        ledger: dict[tuple[str, str], str] = {}
        callback = DirectImdsCallback(base_url=imds.url, hook_ledger=lambda v, e: ledger.get((v, e)))

        wrong = ApprovalFacts.of(event).model_copy(update={"eventType": "Reboot"})
        refused = callback.send(_request(wrong, event_id, "d1"), vm=target)
        assert refused.outcome == "rejected"
        assert "EventType is 'Terminate' here, the decision rested on 'Reboot'" in refused.reason

        drained = ApprovalFacts.of(event, hooks_required=["web_0"])
        undrained = callback.send(_request(drained, event_id, "d2"), vm=target)
        assert (undrained.outcome, undrained.reason) == (
            "rejected",
            "the decision rested on web_0's prepare hooks, and its own ledger says they have not finished",
        )
        assert imds.approvals() == []

        ledger[("web_0", event_id)] = "succeeded"
        approved = callback.send(_request(drained, event_id, "d3"), vm=target)
        assert approved.outcome == "approved"
        assert [a["EventId"] for a in imds.approvals()] == [event_id]
