"""Each attack of a run and what came of it (pure): the forged envelopes the door refused, and why; those it heard;
what a lying listener answered, and whether the events it lied about were approved in IMDS all the same; and the
oracle's findings on the events each attack was about. The oracle prints one line per attack after the run's
verdict; the judgement itself (wrong, missed, duplicate, late, lost) stays oracle/check.py's (and the modules it
calls), from the truth.

An attack with root on the forger's VM (issue 34) **breaches** when the coordinator took what it sent in another VM's
name (an envelope heard under another VM's name or resource id, or with a damaged document) or a lying listener's
answer for that VM's (the history records an approval through it that IMDS never saw); one under its own name (a
scale set not its own) is heard, and judged by its events' findings. An attack is harmless when it did not breach and
no finding names an event it was about; a run with an attack that was not is not OK.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from oracle.intervals import seconds
from oracle.truth import Forgery, Truth
from oracle.verdict import Finding, Report

__all__ = ["AttackOutcome", "outcomes", "summary"]

# The kinds played with root on the forger's VM (local/forgeries.py), which the run's report counts apart.
ROOTED = frozenset({"name", "silence", "name-hook", "name-impact", "squat", "malformed", "liar", "scale-set"})
# Rooted kinds sent under the forger's own name, identity and document: heard by design (a VM may speak for
# itself); what they lie about is judged by the findings on their events.
OWN_NAME = frozenset({"scale-set"})


@dataclass(frozen=True)
class AttackOutcome:
    forgery: Forgery
    refused: tuple[str, ...]  # the door's reason for each of its messages it refused
    about: tuple[str, ...]  # the labels of the events it was about
    findings: tuple[Finding, ...]  # the oracle's findings on those events
    approved: tuple[str, ...] = ()  # a lying listener's: the events it lied about that IMDS saw approved
    taken: tuple[str, ...] = ()  # a lying listener's: the events recorded approved through its victim, not executed

    @property
    def heard(self) -> int:
        return max(0, self.forgery.sent - len(self.refused))

    @property
    def breach(self) -> str:
        """What the coordinator took of the attack ("" when nothing)."""
        if self.forgery.kind not in ROOTED or self.forgery.kind in OWN_NAME:
            return ""
        if self.taken:
            taken = ", ".join(self.taken)
            return f"its lies taken: {taken} recorded approved through {self.forgery.about}, not executed"
        if self.heard:
            return f"{self.heard} of its {self.forgery.sent} envelopes heard"
        return ""

    @property
    def harmless(self) -> bool:
        return not self.findings and not self.breach

    def line(self, start: float) -> str:
        f = self.forgery
        head = f"attack +{seconds(f.at) - start:6.1f}s {f.kind:<12} by {f.by} about {f.about}"
        if f.kind == "liar":
            lied = sorted({event for event, _ in f.answered})
            what = (
                f"answered {len(f.answered)} requests 'approved' with its own proof ({len(lied)} events); "
                f"{len(self.approved)} of them approved in IMDS through the VM itself"
                if f.answered
                else "no request reached it"
            )
        elif not f.sent:
            what = "nothing to send (no event of its victim in its IMDS)"
        else:
            reasons = Counter(_short(reason) for reason in self.refused)
            said = "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common(2))
            what = f"{len(self.refused)}/{f.sent} refused at the door" + (f" ({said})" if said else "")
            if self.heard:
                what += f", {self.heard} heard"
        events = ", ".join(self.about) or "-"
        wrong = [f"BREACH: {self.breach}"] if self.breach else []
        wrong += [f"FINDING: {x.line().strip()}" for x in self.findings]
        return f"{head}: {what}; events {events}: {'; '.join(wrong) or 'harmless'}"


def _short(reason: str) -> str:
    """A refusal in a few words: its head, up to the first detail."""
    head = reason.split(": ", 2)
    text = ": ".join(head[:2]) if head[0] in ("attestation refused", "refused", "invalid envelope") else head[0]
    return text[:90]


def outcomes(truth: Truth, report: Report) -> list[AttackOutcome]:
    """What came of each attack in ``truth``, judged by ``report`` (oracle.check.check of the same truth)."""
    labels = {v.event.eventId.upper(): v.label for v in report.verdicts}
    named = {v.event.eventId.upper(): set(v.event.resources) for v in report.verdicts}
    approved = {a.eventId.upper() for a in truth.approvals}
    executed = {(a.eventId.upper(), a.vm) for a in truth.approvals}
    recorded = {(h.eventId.upper(), h.vm) for h in truth.history if h.kind == "Approval" and h.outcome == "approved"}
    out = []
    for forgery in truth.forgeries:
        digests = set(forgery.digests)
        refused = tuple(letter.reason for letter in truth.deadLetters if letter.sha256 in digests)
        lied = {event.upper() for event, _ in forgery.answered}
        concerned = {e.upper() for e in forgery.events} | lied
        concerned |= {event for event, resources in named.items() if forgery.about in resources}
        about = tuple(sorted(labels.get(event, event[:8]) for event in concerned))
        found = tuple(f for f in report.findings if f.event_id.upper() in concerned)
        out.append(
            AttackOutcome(
                forgery=forgery,
                refused=refused,
                about=about,
                findings=found,
                approved=tuple(sorted(labels.get(e, e[:8]) for e in lied & approved)),
                taken=tuple(
                    sorted(
                        labels.get(e, e[:8])
                        for e in lied
                        if (e, forgery.about) in recorded and (e, forgery.about) not in executed
                    )
                ),
            )
        )
    return out


def summary(played: list[AttackOutcome]) -> str:
    """One line for a set of runs: how many attacks of each kind, how many harmless."""
    kinds = Counter(o.forgery.kind for o in played)
    rooted = [o for o in played if o.forgery.kind in ROOTED]
    breached = [o for o in played if o.breach]
    found = [o for o in played if o.findings]
    shown = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())) or "none"
    return (
        f"attacks: {len(played)} played ({shown}); with root on the forger's VM {len(rooted)}; "
        f"harmless {sum(o.harmless for o in played)}, breached {len(breached)}, with findings on their events "
        f"{len(found)}"
    )
