#!/usr/bin/env bash
# The Entra app registration people sign in with (App Service Authentication on the coordinator), with az only.
# Bicep cannot create it here: the Microsoft Graph Bicep extension exists, but this project cannot compile or
# check it offline, and it needs Graph permissions in the deployment; the same steps with az are idempotent.
#
#   bash scripts/entra-app.sh ensure NAME             create (or find by display name) the registration: app roles
#                                                     ScheduledEvents.Approve and ScheduledEvents.Read, a service
#                                                     principal that only assigned people can sign in to. Prints
#                                                     the application (client) id.
#   bash scripts/entra-app.sh finish APP_ID HOST MI   sign-in redirect to https://HOST/.auth/login/aad/callback and a
#                                                     federated credential trusting the managed identity whose
#                                                     principal (object) id is MI: no client secret exists.
#   bash scripts/entra-app.sh assign APP_ID USER ROLE give a person (UPN or object id) the app role Approve|Read.
#
# Needs a signed-in az with the right to create app registrations (by default every member can; if the tenant
# forbids it, an administrator runs `ensure` once and gives you SE_SIGNIN_CLIENT_ID). Assigning people needs
# ownership of the registration (the creator is owner) or an Entra role that can assign app roles.
set -euo pipefail
ROLE_PREFIX="ScheduledEvents"

die() { echo "entra-app.sh: $*" >&2; exit 1; }

app_roles_json() {
  # Roles users can hold (allowedMemberTypes User); the ids are new GUIDs, created once with the registration.
  printf '[%s,%s]' \
    "{\"allowedMemberTypes\":[\"User\"],\"description\":\"Approve scheduled events by hand\",\"displayName\":\"Approve scheduled events\",\"isEnabled\":true,\"id\":\"$(python3 -c 'import uuid; print(uuid.uuid4())')\",\"value\":\"$ROLE_PREFIX.Approve\"}" \
    "{\"allowedMemberTypes\":[\"User\"],\"description\":\"See pending scheduled events\",\"displayName\":\"Read scheduled events\",\"isEnabled\":true,\"id\":\"$(python3 -c 'import uuid; print(uuid.uuid4())')\",\"value\":\"$ROLE_PREFIX.Read\"}"
}

ensure() {
  local name="$1" app_id roles
  app_id="$(az ad app list --display-name "$name" --query '[0].appId' -o tsv)"
  if [ -z "$app_id" ]; then
    roles="$(mktemp)"
    app_roles_json > "$roles"
    app_id="$(az ad app create --display-name "$name" --sign-in-audience AzureADMyOrg \
      --app-roles "@$roles" --query appId -o tsv)"
    rm -f "$roles"
    echo "entra-app.sh: created app registration $name ($app_id)" >&2
  fi
  for role in Approve Read; do
    [ -n "$(az ad app show --id "$app_id" --query "appRoles[?value=='$ROLE_PREFIX.$role'].id" -o tsv)" ] \
      || die "app registration $app_id has no app role $ROLE_PREFIX.$role: add it (or delete the registration)"
  done
  az ad app update --id "$app_id" --identifier-uris "api://$app_id"
  az ad sp show --id "$app_id" --query id -o tsv >/dev/null 2>&1 || az ad sp create --id "$app_id" >/dev/null
  # Only people (or groups) assigned an app role get a token for this app at all.
  az ad sp update --id "$app_id" --set appRoleAssignmentRequired=true
  echo "$app_id"
}

finish() {
  local app_id="$1" host="$2" principal="$3" tenant issuer
  tenant="$(az account show --query tenantId -o tsv)"
  issuer="$(az cloud show --query endpoints.activeDirectory -o tsv)/$tenant/v2.0"
  az ad app update --id "$app_id" --web-redirect-uris "https://$host/.auth/login/aad/callback" \
    --enable-id-token-issuance false --enable-access-token-issuance false
  if [ -z "$(az ad app federated-credential list --id "$app_id" --query "[?subject=='$principal'].name" -o tsv)" ]; then
    az ad app federated-credential create --id "$app_id" --parameters \
      "{\"name\":\"coordinator-signin-$principal\",\"issuer\":\"$issuer\",\"subject\":\"$principal\",\"audiences\":[\"api://AzureADTokenExchange\"],\"description\":\"App Service Authentication of the coordinator (no client secret)\"}" >/dev/null
  fi
  # A client secret would be a key someone could leak; this registration must not have any.
  [ "$(az ad app credential list --id "$app_id" --query 'length(@)' -o tsv)" = "0" ] \
    || die "app registration $app_id has client secrets or certificates: remove them (sign-in uses the managed identity)"
}

assign() {
  local app_id="$1" user="$2" role="$3" sp role_id principal
  case "$role" in Approve|Read) ;; *) die "ROLE must be Approve or Read, not '$role'";; esac
  sp="$(az ad sp show --id "$app_id" --query id -o tsv)"
  role_id="$(az ad sp show --id "$app_id" --query "appRoles[?value=='$ROLE_PREFIX.$role'].id" -o tsv)"
  [ -n "$role_id" ] || die "no app role $ROLE_PREFIX.$role on $app_id"
  principal="$(az ad user show --id "$user" --query id -o tsv)"
  az rest --method POST --url "https://graph.microsoft.com/v1.0/servicePrincipals/$sp/appRoleAssignedTo" \
    --body "{\"principalId\":\"$principal\",\"resourceId\":\"$sp\",\"appRoleId\":\"$role_id\"}" >/dev/null
  echo "entra-app.sh: $user has $ROLE_PREFIX.$role"
}

command="${1:-}"
shift || true
case "$command" in
  ensure) [ $# -eq 1 ] || die "usage: ensure NAME"; ensure "$@" ;;
  finish) [ $# -eq 3 ] || die "usage: finish APP_ID HOST MANAGED_IDENTITY_PRINCIPAL_ID"; finish "$@" ;;
  assign) [ $# -eq 3 ] || die "usage: assign APP_ID USER Approve|Read"; assign "$@" ;;
  *) die "usage: entra-app.sh ensure|finish|assign ... (see the top of this file)" ;;
esac
