"""coordinator/domain/arm_ids.py: one reading of ARM resource ids for the settings, the census, the Maintenance RP's
acknowledge target, repairs and Event Grid's keys."""

from __future__ import annotations

import pytest

from coordinator.domain.arm_ids import ResourceGroup, is_resource_group, resource_group, scale_set_id

GROUP = "/subscriptions/0000-1111/resourceGroups/rg-Fleet"
UNIFORM = f"{GROUP}/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/7"
FLEXIBLE = f"{GROUP}/providers/Microsoft.Compute/virtualMachines/web_ab12cd"


@pytest.mark.parametrize("resource_id", [GROUP, UNIFORM, FLEXIBLE, GROUP.lower() + "/providers/x"])
def test_the_resource_group_of_an_id_at_or_under_it(resource_id: str) -> None:
    found = resource_group(resource_id)
    assert found is not None
    assert (found.subscription, found.name.lower()) == ("0000-1111", "rg-fleet")
    assert found.id.lower() == GROUP.lower()


@pytest.mark.parametrize(
    "text",
    ["", "/subscriptions/x", "/subscriptions//resourceGroups/rg", "/subscriptions/x/resourceGroups/", "/x" + GROUP],
)
def test_no_resource_group_where_the_id_names_none(text: str) -> None:
    assert resource_group(text) is None
    assert not is_resource_group(text)


def test_a_group_name_is_whole_not_a_prefix_of_a_longer_segment() -> None:
    """``rg-fleet-2`` is not ``rg-fleet``; the match ends at a segment's end."""
    found = resource_group(f"{GROUP}-2/providers/x")
    assert found == ResourceGroup("0000-1111", "rg-Fleet-2", f"{GROUP}-2")


def test_only_a_groups_own_id_is_a_resource_group() -> None:
    assert is_resource_group(GROUP)
    assert is_resource_group(GROUP.upper().replace("SUBSCRIPTIONS", "subscriptions"))
    assert not is_resource_group(FLEXIBLE)
    assert not is_resource_group(GROUP + "/")


def test_a_uniform_instances_scale_set_is_its_ids_parent_whatever_name_is_given() -> None:
    expected = f"{GROUP}/providers/Microsoft.Compute/virtualMachineScaleSets/web"
    assert scale_set_id(UNIFORM, "") == expected
    assert scale_set_id(UNIFORM, "not-web") == expected


def test_a_flexible_members_scale_set_is_in_its_resource_group_by_the_name_given() -> None:
    assert scale_set_id(FLEXIBLE, "web") == f"{GROUP}/providers/Microsoft.Compute/virtualMachineScaleSets/web"
    assert scale_set_id(FLEXIBLE, "") is None


@pytest.mark.parametrize("resource_id", ["", "web_0", GROUP])
def test_no_scale_set_without_a_vm_id(resource_id: str) -> None:
    assert scale_set_id(resource_id, "web") is None
