"""``python -m ops.drill KIND --scale-set ID --vm NAME…``: trigger a real scheduled event on chosen VMs of a scale
set through ARM (reboot, redeploy, evict, delete), to rehearse hooks and policies.

Takes a command line; prints the plan (every call with its URL, api-version and body, and the event each VM should
see with its notice), and with ``--confirm`` makes the calls and follows each operation to its end. Without
``--confirm`` (the default) it only reads (the scale set and its VMs) and sends nothing. Exits 0 when all is well,
1 when a call failed or did not end in time, 2 on bad input or a refused drill. Authenticates with azure-identity's
DefaultAzureCredential (the Azure CLI's sign-in, a managed identity, environment variables…).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, NoReturn

from azure.core.exceptions import AzureError, ClientAuthenticationError
from azure.identity import DefaultAzureCredential

from coordinator import ARM_ENDPOINT, ArmClient, ArmOptions
from ops import command
from ops.drill.calls import Outcome, execute, read_instances, read_scale_set
from ops.drill.plan import KINDS, DrillInputError, check_scale_set_id, choose, describe, plan

OK, FAILED, BAD_INPUT = 0, 1, 2
EPILOG = """kinds:
  reboot    VirtualMachineScaleSets_Restart with instanceIds     → Reboot (User), 15 min notice
  redeploy  VirtualMachineScaleSets_Redeploy with instanceIds    → Redeploy (User), 10 min notice
  evict     …/virtualMachines/{instanceId}/simulateEviction       → Preempt, 30 s notice (Spot VMs only)
  delete    VirtualMachineScaleSets_DeleteInstances (scale-in)    → Terminate, the scale set's notBeforeTimeout
  (a user's Reboot/Redeploy comes Started, without notice, if the scale set's scheduledEventsPolicy approves it)

exit codes: 0 planned (dry run) or every call ended well, 1 a call failed or did not end in time,
            2 bad input, a refused drill, or ARM unreadable

example:
  python -m ops.drill reboot --vm web_0 --scale-set \\
      /subscriptions/SUB/resourceGroups/rg-sefleet/providers/Microsoft.Compute/virtualMachineScaleSets/sefleet-vmss
  python -m ops.drill reboot --vm web_0 --scale-set … --confirm     (does it)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=command.prog("ops.drill"),
        description="Trigger a real scheduled event on chosen VMs of a scale set through ARM, to rehearse hooks "
        "and policies. A dry run (the default) prints what it would do and sends nothing.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--scale-set", required=True, help="the scale set's resource id")
    parser.add_argument(
        "--vm", action="append", required=True, help="a VM of the scale set, by name or instance id (repeat)"
    )
    parser.add_argument("--confirm", action="store_true", help="make the calls (default: a dry run)")
    parser.add_argument("--no-wait", action="store_true", help="do not follow the operations to their end")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to follow each operation")
    parser.add_argument("--endpoint", default=ARM_ENDPOINT, help="ARM's endpoint (the IMDS emulator's locally)")
    parser.add_argument("--json", action="store_true", help="one JSON object: the plan and the outcomes")
    args = parser.parse_args(argv)
    # Each credential DefaultAzureCredential tried, logged as a warning (~30 lines) before the error says it again:
    # the one line below says what to do.
    logging.getLogger("azure.identity").setLevel(logging.ERROR)
    try:
        scale_set_id = check_scale_set_id(args.scale_set)
        client = ArmClient(
            credential=DefaultAzureCredential(), moniker="drill", options=ArmOptions(endpoint=args.endpoint)
        )
    except (DrillInputError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return BAD_INPUT
    try:
        return _run(args, client, scale_set_id)
    except DrillInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return BAD_INPUT
    except ClientAuthenticationError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(
            f"error: no Azure credential: {first[:300]} Sign in with `az login` (or run where a managed identity "
            "or the AZURE_CLIENT_ID/AZURE_TENANT_ID variables are set), then run again.",
            file=sys.stderr,
        )
        return BAD_INPUT
    except AzureError as error:
        print(f"error: ARM: {type(error).__name__}: {str(error)[:500]}", file=sys.stderr)
        return BAD_INPUT
    finally:
        client.close()


def _run(args: argparse.Namespace, client: ArmClient, scale_set_id: str) -> int:
    scale_set = read_scale_set(client, scale_set_id)
    chosen = choose(read_instances(client, scale_set), args.vm)
    drill = plan(args.kind, scale_set, chosen, endpoint=args.endpoint)
    report: dict[str, Any] = {"plan": drill.as_json(), "confirmed": bool(args.confirm), "outcomes": []}
    if not args.json:
        print(describe(drill))
    if drill.refusals:
        if args.json:
            print(json.dumps(report))
        print("refused: nothing sent", file=sys.stderr)
        return BAD_INPUT
    if not args.confirm:
        if args.json:
            print(json.dumps(report))
        else:
            print("dry run: nothing sent (only the scale set and its VMs were read); add --confirm to do it")
        return OK
    outcomes: list[Outcome] = []
    for call in drill.calls:
        outcome = execute(client, call, timeout=args.timeout, wait=not args.no_wait)
        outcomes.append(outcome)
        if not args.json:
            detail = f" ({outcome.error})" if outcome.error else ""
            state = outcome.state or "refused"
            print(f"{call.method} {call.url}: ARM {outcome.status}, {state} after {outcome.seconds:.1f} s{detail}")
    report["outcomes"] = [
        {"url": o.call.url, "status": o.status, "state": o.state, "seconds": round(o.seconds, 3), "error": o.error}
        for o in outcomes
    ]
    if args.json:
        print(json.dumps(report))
    return OK if all(outcome.ok for outcome in outcomes) else FAILED


def cli() -> NoReturn:
    """The console command ``sefleet-drill``."""
    command.run(main)


if __name__ == "__main__":
    cli()
