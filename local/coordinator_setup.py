"""The coordinator (``function_app``) as a local stack runs it: its app settings, the policy it reads (its gates
pointed at the pages the stack serves), the IMDS emulator's root as its trust anchor, approvals straight into the
IMDS emulator when there is no Relay, and its Functions hosts in this process."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import requests

from emulators.imds import Scenario
from emulators.imds.attested import ROOT_PATH
from emulators.tls import local_tls
from local.direct_callback import direct_coordinator, forwarder_hook_ledger
from local.easy_auth import PLATFORM_SETTINGS
from local.gates import GateServer, local_gate_names
from local.health_pages import HealthPages
from local.host import function_hosts
from local.queue_trigger import StorageQueue
from local.runner import FunctionHost, IngestFunction
from local.scenario import census_scopes, served_policy
from local.stack_options import LOCAL_CLOCK_TOLERANCE

# Variables that would steer azure-identity away from the identity the stack gives the coordinator (App Service's
# flow, emulators/app_identity.py): unset before its settings are applied.
IDENTITY_VARIABLES = (
    "AZURE_POD_IDENTITY_AUTHORITY_HOST",
    "IDENTITY_ENDPOINT",
    "IDENTITY_HEADER",
    "IMDS_ENDPOINT",
    "MSI_ENDPOINT",
    "MSI_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_CERTIFICATE_PATH",
)
# With health pages, the coordinator's policy: the run's, its gates pointed at the pages the stack serves.
POLICY_COPY = "policy.yaml"
# The Azurite SAS the coordinator's delivery queue and the local queue trigger use: longer than any local run.
QUEUE_SAS_LIFETIME = timedelta(days=1)


# Scale sets' automatic repairs suspended around disruptive events (pipeline/repairs.py), through the IMDS emulator's
# ARM face as the census is.
REPAIRS_SETTINGS = {"COORDINATOR_SUSPEND_REPAIRS": "true"}


def coordinator_settings(
    *,
    storage_connection_string: str,
    history_path: Path,
    cards_dir: Path,
    public_url: str,
    hubs: tuple[str, str],
    scenario: Scenario,
    arm_endpoint: str,
    imds_url: str,
    identity: Mapping[str, str],
    retire_grace_seconds: int,
    trust_anchors: Path,
    delivery_queue: tuple[str, str],
    relay_url: str | None,
    policy_path: Path,
) -> dict[str, str]:
    """The app settings of the stack's coordinator: its storage, history and cards, its hubs (the VMs', the
    platform's), the census and managed identity through the IMDS emulator, the attestation roots, the delivery
    queue (its URL and SAS) and the approval path."""
    hub, platform_hub = hubs
    env = {
        "COORDINATOR_STORAGE_CONNECTION_STRING": storage_connection_string,
        "COORDINATOR_HISTORY_SQLITE_PATH": str(history_path),
        "COORDINATOR_CARDS_FOLDER": str(cards_dir),
        "COORDINATOR_PUBLIC_BASE_URL": public_url,
        # People sign in at the stand-in in front of the app, which tells the app so as App Service does.
        **PLATFORM_SETTINGS,
        "EVENTHUB_NAME": hub,
        "PLATFORM_EVENTHUB_NAME": platform_hub,
        "EVENTHUB_CONSUMER_GROUP": "$Default",
        # The census (budgets, tag rules) from the IMDS emulator's ARM face (over TLS, as ARM), read with the
        # coordinator's managed identity as in Azure: the scenario's resource groups, the same VMs IMDS serves.
        "COORDINATOR_CENSUS_RESOURCE_GROUPS": ",".join(census_scopes(scenario)),
        "COORDINATOR_ARM_ENDPOINT": arm_endpoint,
        **REPAIRS_SETTINGS,
        # The coordinator's DefaultAzureCredential takes App Service's managed-identity flow (IDENTITY_ENDPOINT,
        # IDENTITY_HEADER and the user-assigned identity's client id, as in Azure): emulators/app_identity.py mints
        # Entra-shaped JWTs naming the coordinator's own identity, which the emulators verify.
        **identity,
        # Retire a removed VM after three of the local heartbeat intervals of silence, as Azure's 180 s are three
        # 60 s heartbeats: the run then sees the coordinator conclude the events of the VMs deletes removed.
        "COORDINATOR_RETIRE_GRACE_SECONDS": str(retire_grace_seconds),
        # Attested documents are the IMDS emulator's, so its root is the trust anchor, as Microsoft's roots are
        # in Azure; its issuing CA is fetched from the signing certificate's CA Issuers URL, on the emulator.
        "COORDINATOR_ATTESTATION_TRUST_ANCHORS": str(trust_anchors),
        "COORDINATOR_ATTESTATION_ISSUER_URLS": imds_url + "/_emulator/pki/",
    }
    # Approvals not answered within a run's few seconds continue through the delivery queue, in Azurite.
    env["COORDINATOR_DELIVERY_QUEUE_URL"], env["COORDINATOR_DELIVERY_QUEUE_SAS"] = delivery_queue
    env |= {"COORDINATOR_RELAY_ENDPOINT": relay_url} if relay_url is not None else {}
    # Agentless VMs are approved through the Maintenance RP's acknowledge: the IMDS emulator's ARM face, with a token
    # from the same managed-identity endpoint.
    env |= {"COORDINATOR_REMOTE_ACKNOWLEDGE": "fallback"} if any(vm.agentless for vm in scenario.vms) else {}
    env["COORDINATOR_POLICY_PATH"] = str(policy_path)
    env |= {"COORDINATOR_SHADOW_POLICY_PATH": scenario.shadowPolicy} if scenario.shadowPolicy else {}
    # Every process here reads one clock: the tolerance for clocks that disagree (2 s in Azure) would be two
    # minutes of a run at 60x, long enough to keep a compressed Terminate notice from being approved at all.
    env["COORDINATOR_CLOCK_TOLERANCE_SECONDS"] = str(LOCAL_CLOCK_TOLERANCE)
    return env


def coordinator_policy(policy: Path, health_pages: HealthPages | None, workdir: Path) -> tuple[Path, GateServer | None]:
    """The policy the coordinator reads: the run's, or a copy in the work folder whose gates probe what the stack
    serves: the scenario's health pages (``healthPages``) and the local gate pages (``http://local-gates/{name}``,
    local/gates.py), with the gate server it then started."""
    text = policy.read_text(encoding="utf-8")
    served = text
    if health_pages is not None and health_pages.served:
        served = served_policy(served, health_pages.served)
    gates = None
    names = local_gate_names(served)
    if names:
        gates = GateServer(names)
        gates.start()
        served = gates.rewrite_policy(served)
    if served == text:
        return policy.resolve(), gates
    copy = workdir / POLICY_COPY
    copy.write_text(served, encoding="utf-8")
    return copy.resolve(), gates


def imds_root(imds_url: str, workdir: Path) -> Path:
    """The IMDS emulator's root certificate, as it serves it, in the work folder."""
    path = workdir / "imds-root.pem"
    path.write_bytes(requests.get(imds_url + ROOT_PATH, timeout=10).content)
    return path


class AppSettings:
    """This process's environment as the Functions host's app settings: each one set remembers what it replaced,
    and ``restore`` puts that back."""

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}

    def set(self, name: str, value: str | None) -> None:
        if name not in self._saved:
            self._saved[name] = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def apply(self, env: dict[str, str]) -> None:
        """The coordinator's settings, with the variables that would steer its managed identity elsewhere unset and
        the emulators' local CA trusted through the usual settings (emulators/tls.py): by the coordinator's clients
        (Relay, ARM) and by every process started from this environment (forwarders, the coordinator's own)."""
        for name in IDENTITY_VARIABLES:
            self.set(name, None)
        for name, value in {**local_tls().client_env(), **env}.items():
            self.set(name, value)

    def restore(self) -> None:
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved.clear()


def approve_directly(workdir: Path, imds_url: str) -> tuple[ModuleType, Callable[[], Any]]:
    """Without the Relay emulator, approvals go straight into the IMDS emulator (local/direct_callback.py), judged
    against each VM's own hook ledger in its forwarder's state, as its listener would; returns the module and the
    coordinator builder it replaced, to put back at the end."""
    import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

    replaced = (function_app, function_app.coordinator)
    ledger = forwarder_hook_ledger(workdir / "vms")
    function_app.coordinator = direct_coordinator(function_app.settings, imds_url, hook_ledger=ledger)
    return replaced


def in_process_hosts(
    *,
    eventhub_connection_string: str,
    queues: tuple[StorageQueue, StorageQueue],
    timer_interval: float,
    ingest_wrapper: Callable[[IngestFunction], IngestFunction] | None,
) -> tuple[FunctionHost, FunctionHost]:
    """The VMs' trigger (with the timer and the delivery queue's) and Event Grid's, in this process."""
    import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

    ingest: IngestFunction = function_app.ingest_envelopes
    if ingest_wrapper is not None:
        ingest = ingest_wrapper(ingest)
    return function_hosts(
        function_app,
        eventhub_connection_string=eventhub_connection_string,
        queues=queues,
        timer_interval=timer_interval,
        ingest=ingest,
    )


def function_app_module() -> ModuleType:
    import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

    return function_app


def reset_function_app() -> None:
    """A new Functions worker process would read the app settings afresh; so does the next stack in this process."""
    module = sys.modules.get("function_app")
    if module is None:
        return
    module.settings.cache_clear()
    coordinator = module.coordinator
    if coordinator.cache_info().currsize:
        with contextlib.suppress(Exception):
            coordinator().close()  # the batches' tails end first: they write history
        with contextlib.suppress(Exception):
            coordinator().parts.history.close()
    coordinator.cache_clear()
