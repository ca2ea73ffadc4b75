"""The oracle's attacks (issue 34), pure and fast: each attack of a run matched to what the door refused and to the
findings on its events; an attack with root whose envelopes were heard, or whose lies were taken, breaches; a
delay it causes is not excused (only the lies without root may make the coordinator wait); the generator adds
attackers from a stream of their own, leaving the rest of each seed's plan as it was."""

from __future__ import annotations

from oracle.attacks import outcomes, summary
from oracle.check import check
from oracle.generate import generate
from oracle.hostile import ROOTED_ATTACKS
from oracle.truth import DeadLetter, Forgery, HistoryStep
from tests.oracle.test_check import approval, at, event, kinds, truth

NAMED = "vm.name 'web_0' is not its resource id's name: ARM names … 'web_1': a VM speaks under another VM's name"


def test_an_attack_whose_envelopes_the_door_refused_is_harmless_and_says_why() -> None:
    freeze = event("freeze", "Freeze", ["web_0"], 1, 16)
    forgery = Forgery(at=at(1), by="web_1", about="web_0", kind="name", events=[freeze.eventId], sent=1, digests=["d1"])
    run = truth([freeze], [], forgeries=[forgery], deadLetters=[DeadLetter(at=at(1), reason=NAMED, sha256="d1")])
    report = check(run)
    (outcome,) = outcomes(run, report)
    assert (outcome.harmless, outcome.breach, outcome.refused) == (False, "", (NAMED,))
    # The forgery is no excuse: its event was due, and missed.
    assert kinds(report) == ["missed"]
    assert "1/1 refused at the door" in outcome.line(0.0)
    assert "FINDING: MISSED" in outcome.line(0.0)


def test_an_envelope_in_another_vms_name_that_was_heard_is_a_breach() -> None:
    freeze = event("freeze", "Freeze", ["web_0"], 1, 16)
    forgery = Forgery(at=at(1), by="web_1", about="web_0", kind="silence", events=[freeze.eventId], sent=2)
    run = truth([freeze], [], forgeries=[forgery])
    (outcome,) = outcomes(run, check(run))
    assert outcome.breach == "2 of its 2 envelopes heard"
    assert "breached 1" in summary([outcome])


def test_a_vm_lying_under_its_own_name_is_heard_and_judged_by_its_events() -> None:
    """web_0 reports its own Freeze again under another scale set's name: heard by design (a VM speaks for itself),
    no breach; harmless while its event's verdict holds, not once its event has a finding."""
    freeze = event("freeze", "Freeze", ["web_0"], 1, 16, started=2, reason="approval")
    lie = Forgery(at=at(1), by="web_0", about="web_0", kind="scale-set", events=[freeze.eventId], sent=1)
    kept = truth([freeze], [approval(freeze, 2)], forgeries=[lie])
    (outcome,) = outcomes(kept, check(kept))
    assert (outcome.heard, outcome.breach, outcome.harmless) == (1, "", True)
    missed = truth([freeze], [], forgeries=[lie])
    (outcome,) = outcomes(missed, check(missed))
    assert (outcome.breach, outcome.harmless) == ("", False)
    assert "FINDING: MISSED" in outcome.line(0.0)


def test_a_lie_recorded_as_the_vms_approval_without_startrequests_is_a_breach() -> None:
    freeze = event("freeze", "Freeze", ["web_0"], 1, 16)
    liar = Forgery(at=at(0), by="web_1", about="web_0", kind="liar", events=[], answered=[(freeze.eventId, "d-1")])
    taken = HistoryStep(at=at(2), kind="Approval", eventId=freeze.eventId, outcome="approved", vm="web_0")
    run = truth([freeze], [], forgeries=[liar], history=[taken])
    (outcome,) = outcomes(run, check(run))
    assert outcome.breach == "its lies taken: freeze recorded approved through web_0, not executed"
    # Refused (the answer's proof is not web_0's) and approved through web_0 itself: harmless.
    honest = truth([freeze], [], forgeries=[liar])
    (refused,) = outcomes(honest, check(honest))
    assert refused.breach == ""


def test_the_generator_adds_attackers_from_a_stream_of_their_own() -> None:
    for seed in range(20):
        with_them, without = generate(seed), generate(seed, attackers=False)
        rooted = [s for s in with_them.scenario_data["steps"] if s.get("forge", {}).get("kind") in ROOTED_ATTACKS]
        assert [s for s in with_them.scenario_data["steps"] if s not in rooted] == without.scenario_data["steps"]
        assert without.policy == with_them.policy
    played = {
        s["forge"]["kind"]
        for seed in range(100)
        for s in generate(seed).scenario_data["steps"]
        if s.get("forge", {}).get("kind") in ROOTED_ATTACKS
    }
    assert played == set(ROOTED_ATTACKS)
