#!/usr/bin/env bash
# One command that deploys the whole fleet to Azure, secure, with az only (docs/deploy.md):
#
#   export SE_SSH_PUBLIC_KEY="$(cat ~/.ssh/id_ed25519.pub)" SE_TEAMS_WORKFLOW_URL='https://…'   # never commit it
#   bash scripts/deploy.sh RESOURCE_GROUP LOCATION [INSTANCE_COUNT]
#
# Steps, each safe to run again:
#   1. build the forwarder package and its SHA-256 (VMs install only that exact file) and the Functions package;
#   2. the Entra app registration people sign in with (scripts/entra-app.sh: app roles, no client secret);
#   3. infra/main.bicep with infra/main.bicepparam (values from the environment), keeping the scale set's current
#      size, so that no new instance boots before its package is uploaded;
#   4. the app registration trusts the Functions app's sign-in identity (federated credential) and redirects to it;
#   5. Relay: delete the namespace's built-in SAS rule (Relay has no switch to turn SAS off) and check none is left;
#      Event Grid: no Data Sender on the VMs' hub for the system topic (a deployment from before Event Grid had its
#      own hub granted it there; an incremental deployment deletes nothing);
#   6. upload the forwarder package (to its own storage account, with your Entra identity) and publish the app;
#   7. deploy again with INSTANCE_COUNT (default: the scale set's current size, 0 on the first run).
# Then give people their role:  bash scripts/entra-app.sh assign "$SE_SIGNIN_CLIENT_ID" alice@contoso.com Approve
#
# azd users: `azd up` runs the same steps through the hooks in azure.yaml (deploy.sh prepare / finish).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

die() { echo "deploy.sh: $*" >&2; exit 1; }
say() { echo "deploy.sh: $*" >&2; }

AZ_MINIMUM=2.61.0  # README, Prerequisites

# What every step needs, checked before anything is built or deployed: the Azure CLI, recent enough, with Bicep
# (main.bicep is compiled by `az deployment`), and a signed-in account.
preflight() {
  command -v az >/dev/null 2>&1 \
    || die "the Azure CLI (az) is not installed: https://learn.microsoft.com/cli/azure/install-azure-cli (>= $AZ_MINIMUM)"
  local version bicep
  version="$(az version --query '"azure-cli"' -o tsv 2>/dev/null)" || die "az version failed: reinstall the Azure CLI"
  [ "$(printf '%s\n%s\n' "$AZ_MINIMUM" "$version" | sort -V | head -n 1)" = "$AZ_MINIMUM" ] \
    || die "Azure CLI $version is older than $AZ_MINIMUM: az upgrade"
  # `az bicep version` prints "Bicep CLI version X" when Bicep is there; without it some az versions still exit 0.
  bicep="$(az bicep version 2>&1 || true)"
  case "$bicep" in
    *"Bicep CLI version"*) ;;
    *) die "Bicep is not installed for the Azure CLI: az bicep install" ;;
  esac
  az account show --query id -o tsv >/dev/null 2>&1 || die "not signed in to Azure: az login"
}

# Step 1 and 2: what the template needs before it runs (exported for main.bicepparam's readEnvironmentVariable).
prepare() {
  preflight
  [ -n "${SE_SSH_PUBLIC_KEY:-}" ] || die "set SE_SSH_PUBLIC_KEY to the administrator's OpenSSH public key"
  [ -n "${SE_TEAMS_WORKFLOW_URL:-}" ] || die "set SE_TEAMS_WORKFLOW_URL to the Teams Workflows webhook URL"
  SE_FORWARDER_PACKAGE_SHA256="$(bash scripts/package-forwarder.sh build | cut -d' ' -f1)"
  bash scripts/package-functions.sh build >/dev/null
  SE_SIGNIN_CLIENT_ID="${SE_SIGNIN_CLIENT_ID:-$(bash scripts/entra-app.sh ensure "${SE_SIGNIN_APP_NAME:-scheduled-events-approvers}")}"
  export SE_FORWARDER_PACKAGE_SHA256 SE_SIGNIN_CLIENT_ID
  say "forwarder package sha256 $SE_FORWARDER_PACKAGE_SHA256; sign-in app $SE_SIGNIN_CLIENT_ID"
}

# Steps 4 to 6, from the outputs of a finished deployment.
finish() {
  local group="$1" deployment="$2"
  out() { az deployment group show -g "$group" -n "$deployment" --query "properties.outputs.$1.value" -o tsv; }
  local app host relay packages signin_principal me container
  app="$(out functionAppName)"; host="$(out functionAppHostName)"; relay="$(out relayNamespaceName)"
  packages="$(out packageStorageAccountName)"; signin_principal="$(out signInIdentityPrincipalId)"

  bash scripts/entra-app.sh finish "$SE_SIGNIN_CLIENT_ID" "$host" "$signin_principal"

  if az relay namespace authorization-rule show -g "$group" --namespace-name "$relay" \
      --name RootManageSharedAccessKey >/dev/null 2>&1; then
    az relay namespace authorization-rule delete -g "$group" --namespace-name "$relay" --name RootManageSharedAccessKey
  fi
  [ "$(az relay namespace authorization-rule list -g "$group" --namespace-name "$relay" --query 'length(@)' -o tsv)" = "0" ] \
    || die "Relay namespace $relay still has SAS rules: delete them (only Entra ID may reach Relay)"

  # Event Grid delivers to its own hub now, where only the system topic may send: a grant an older deployment gave it
  # on the VMs' hub is removed (the template no longer declares it, and an incremental deployment deletes nothing).
  local namespace hub topics principal
  namespace="$(out eventHubNamespace)"; namespace="${namespace%%.*}"
  hub="$(az eventhubs eventhub show -g "$group" --namespace-name "$namespace" -n "$(out eventHubName)" --query id -o tsv)"
  topics="$(az eventgrid system-topic list -g "$group" \
    --query "[?topicType=='Microsoft.ResourceNotifications.MaintenanceResources'].identity.principalId" -o tsv)"
  for principal in $topics; do
    if [ "$(az role assignment list --assignee "$principal" --scope "$hub" --query 'length(@)' -o tsv)" != "0" ]; then
      az role assignment delete --assignee "$principal" --scope "$hub" --role "Azure Event Hubs Data Sender"
      say "removed the Event Grid topic's Data Sender on the VMs' hub (it delivers to its own hub)"
    fi
  done

  # Upload with your own identity: a data role on the one package container (granted once; it can take minutes
  # to apply, hence the retries). The coordinator has no role on this account.
  me="$(az ad signed-in-user show --query id -o tsv)"
  container="$(az storage account show -n "$packages" --query id -o tsv)/blobServices/default/containers/forwarder"
  az role assignment create --assignee-object-id "$me" --assignee-principal-type User \
    --role "Storage Blob Data Contributor" --scope "$container" >/dev/null
  for attempt in $(seq 1 20); do
    if az storage blob upload --auth-mode login --account-name "$packages" --container-name forwarder \
        --name forwarder.tar.gz --file build/forwarder.tar.gz --overwrite >/dev/null 2>&1; then
      break
    fi
    [ "$attempt" -lt 20 ] || die "could not upload build/forwarder.tar.gz to $packages (role assignment not applied?)"
    say "upload attempt $attempt refused (role assignments take minutes to apply); retrying in 30 s"
    sleep 30
  done
  az functionapp deployment source config-zip -g "$group" -n "$app" --src build/app.zip --build-remote true >/dev/null
  say "published the coordinator to https://$host and the forwarder package to $packages"
}

provision() {
  local group="$1" deployment="$2" count="$3"
  az deployment group create -g "$group" -n "$deployment" -f infra/main.bicep -p infra/main.bicepparam \
    -p instanceCount="$count" --query properties.provisioningState -o tsv
}

current_count() {
  local group="$1" deployment="$2" vmss
  vmss="$(az deployment group show -g "$group" -n "$deployment" --query properties.outputs.vmssName.value -o tsv 2>/dev/null || true)"
  if [ -n "$vmss" ]; then az vmss show -g "$group" -n "$vmss" --query sku.capacity -o tsv; else echo 0; fi
}

main() {
  [ $# -ge 2 ] || die "usage: deploy.sh RESOURCE_GROUP LOCATION [INSTANCE_COUNT]"
  local group="$1" location="$2" deployment="sefleet" now
  prepare
  az group create -n "$group" -l "$location" --query properties.provisioningState -o tsv
  now="$(current_count "$group" "$deployment")"
  provision "$group" "$deployment" "$now"
  finish "$group" "$deployment"
  provision "$group" "$deployment" "${3:-$now}"
  say "done. Give people a role: bash scripts/entra-app.sh assign $SE_SIGNIN_CLIENT_ID <user> Approve"
}

case "${1:-}" in
  # azd hooks (azure.yaml): azd provisions in between and keeps the values in its environment.
  prepare)
    prepare
    azd env set SE_FORWARDER_PACKAGE_SHA256 "$SE_FORWARDER_PACKAGE_SHA256"
    azd env set SE_SIGNIN_CLIENT_ID "$SE_SIGNIN_CLIENT_ID"
    ;;
  finish)
    [ -n "${AZURE_RESOURCE_GROUP:-}" ] || die "AZURE_RESOURCE_GROUP is not set (azd sets it)"
    [ -n "${SE_SIGNIN_CLIENT_ID:-}" ] || die "SE_SIGNIN_CLIENT_ID is not set (the prepare hook sets it)"
    finish "$AZURE_RESOURCE_GROUP" "$(az deployment group list -g "$AZURE_RESOURCE_GROUP" \
      --query "sort_by([?properties.outputs.functionAppName], &properties.timestamp)[-1].name" -o tsv)"
    ;;
  *) main "$@" ;;
esac
