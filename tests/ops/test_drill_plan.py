"""What a drill plans from what ARM says of the scale set (ops/drill/plan.py, pure): the calls with their URL,
api-version and body, the event and notice each VM should see, and the drills refused before anything is sent."""

from __future__ import annotations

from typing import Any

import pytest

from ops.drill.plan import (
    DrillInputError,
    Instance,
    ScaleSet,
    check_scale_set_id,
    choose,
    describe,
    iso_duration_seconds,
    plan,
)

SS = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web"
ARM = "https://management.azure.com"


def scale_set(**properties: Any) -> ScaleSet:
    return ScaleSet.model_validate({"id": SS, "name": "web", "location": "westeurope", "properties": properties})


def instance(number: int, **properties: Any) -> Instance:
    return Instance.model_validate(
        {
            "id": f"{SS}/virtualMachines/{number}",
            "name": f"web_{number}",
            "instanceId": str(number),
            "properties": properties,
        }
    )


TERMINATE = {"scheduledEventsProfile": {"terminateNotificationProfile": {"enable": True, "notBeforeTimeout": "PT7M"}}}


def test_iso_durations_of_a_not_before_timeout() -> None:
    assert iso_duration_seconds("PT15M") == 900
    assert iso_duration_seconds("PT1H") == 3600
    assert iso_duration_seconds("PT5M30S") == 330
    assert iso_duration_seconds("P1D") is None
    assert iso_duration_seconds("PT") is None


def test_a_reboot_is_one_restart_with_the_instance_ids_and_a_15_minute_notice_each() -> None:
    drill = plan("reboot", scale_set(), [instance(0), instance(3)], endpoint=ARM)
    (call,) = drill.calls
    assert (call.method, call.url) == ("POST", f"{ARM}{SS}/restart?api-version=2025-04-01")
    assert call.body == {"instanceIds": ["0", "3"]}
    assert [(e.vm, e.eventType, e.eventSource, e.noticeSeconds) for e in drill.expected] == [
        ("web_0", "Reboot", "User", 900.0),
        ("web_3", "Reboot", "User", 900.0),
    ]
    text = describe(drill)
    assert f"POST {ARM}{SS}/restart?api-version=2025-04-01" in text
    assert 'body {"instanceIds": ["0", "3"]}' in text
    assert "expect on web_3: Reboot (EventSource User), NotBefore 15 min after the call" in text


def test_a_user_reboot_or_redeploy_the_policy_approves_comes_without_notice() -> None:
    automatic = scale_set(scheduledEventsPolicy={"userInitiatedRedeploy": {"automaticallyApprove": True}})
    assert [e.noticeSeconds for e in plan("redeploy", automatic, [instance(0)], endpoint=ARM).expected] == [None]
    assert [e.noticeSeconds for e in plan("reboot", automatic, [instance(0)], endpoint=ARM).expected] == [900.0]
    assert "no notice (created Started)" in describe(plan("redeploy", automatic, [instance(0)], endpoint=ARM))


def test_a_delete_takes_the_scale_sets_not_before_timeout_and_is_refused_without_one() -> None:
    drill = plan("delete", scale_set(virtualMachineProfile=TERMINATE), [instance(1)], endpoint=ARM)
    assert drill.calls[0].url == f"{ARM}{SS}/delete?api-version=2025-04-01"
    assert [(e.eventType, e.noticeSeconds) for e in drill.expected] == [("Terminate", 420.0)]
    refused = plan("delete", scale_set(), [instance(1)], endpoint=ARM)
    assert refused.calls == []
    assert "no terminateNotificationProfile" in refused.refusals[0]
    spot = plan(
        "delete", scale_set(virtualMachineProfile={**TERMINATE, "priority": "Spot"}), [instance(1)], endpoint=ARM
    )
    assert "Spot VM's delete raises no Terminate" in spot.refusals[0]


def test_an_eviction_is_one_call_per_spot_vm_and_refused_for_a_regular_one() -> None:
    spot = scale_set(virtualMachineProfile={"priority": "Spot"})
    drill = plan("evict", spot, [instance(0), instance(2)], endpoint=ARM)
    assert [c.url for c in drill.calls] == [
        f"{ARM}{SS}/virtualMachines/0/simulateEviction?api-version=2025-04-01",
        f"{ARM}{SS}/virtualMachines/2/simulateEviction?api-version=2025-04-01",
    ]
    assert {(e.eventType, e.eventSource, e.noticeSeconds) for e in drill.expected} == {("Preempt", "Platform", 30.0)}
    refused = plan("evict", scale_set(), [instance(0)], endpoint=ARM)
    assert (refused.calls, refused.refusals) == (
        [],
        ["web_0: simulateEviction applies to Spot VMs only (priority Regular)"],
    )


def test_a_flexible_scale_set_names_its_members_by_name_and_evicts_the_vm_resource() -> None:
    flexible = scale_set(orchestrationMode="Flexible")
    member = Instance.model_validate(
        {
            "id": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/web-a1",
            "name": "web-a1",
            "properties": {"priority": "Spot"},
        }
    )
    assert plan("reboot", flexible, [member], endpoint=ARM).calls[0].body == {"instanceIds": ["web-a1"]}
    assert (
        plan("evict", flexible, [member], endpoint=ARM).calls[0].url
        == f"{ARM}{member.id}/simulateEviction?api-version=2025-04-01"
    )


def test_vms_are_chosen_by_name_or_instance_id_and_an_unknown_one_is_named() -> None:
    instances = [instance(0), instance(1)]
    assert [i.name for i in choose(instances, ["1", "WEB_0", "web_1"])] == ["web_1", "web_0"]
    with pytest.raises(DrillInputError, match=r"\['web_9'\] are not VMs of the scale set \(its VMs: web_0, web_1\)"):
        choose(instances, ["web_9"])
    with pytest.raises(DrillInputError, match="not a scale set's resource id"):
        check_scale_set_id("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/x")
