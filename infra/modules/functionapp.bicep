// The coordinator: a Python 3.11 Functions app on the Flex Consumption plan. Every connection is identity-based
// (the coordinator's user-assigned identity); the only secret it uses comes from Key Vault by reference.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Resource id of the coordinator identity.')
param identityId string

@description('Client id of the coordinator identity.')
param identityClientId string

@description('Application (client) id of the Entra app registration people sign in with (app roles ScheduledEvents.Approve / ScheduledEvents.Read).')
param signInClientId string

@description('Entra tenant of that app registration: only its accounts can sign in.')
param signInTenantId string

@description('Resource id of the sign-in identity (the app registration trusts it instead of a client secret).')
param signInIdentityId string

@description('Client id of the sign-in identity.')
param signInIdentityClientId string

@description('Storage account blob endpoint (host storage).')
param blobEndpoint string

@description('Storage account queue endpoint (host storage).')
param queueEndpoint string

@description('URL of the delivery queue (approvals a run could not deliver within its few seconds).')
param deliveryQueueUrl string

@description('Storage account table endpoint (coordinator state).')
param tableEndpoint string

@description('Blob container URL the Flex Consumption plan deploys the app package from.')
param deploymentContainerUrl string

@description('Name of the Application Insights component.')
param appInsightsName string

@description('Event Hubs fully qualified namespace.')
param eventHubNamespace string

@description('Event hub that carries the envelopes.')
param eventHubName string

@description('Event hub of Event Grid\'s scheduled events (the platform\'s channel; the second trigger).')
param platformEventHubName string

@description('Consumer group of the coordinator.')
param consumerGroupName string

@description('Table of the coordinator state.')
param stateTableName string

@description('Azure Relay fully qualified namespace.')
param relayNamespace string

@description('Logs ingestion endpoint of the history DCR.')
param logsIngestionEndpoint string

@description('Immutable id of the history DCR.')
param historyDcrImmutableId string

@description('Stream name of the history DCR (Custom-...).')
param historyStreamName string

@description('Key Vault URI of the Teams Workflows URL secret (a reference, not the value).')
param teamsUrlEntryUri string

@description('Seconds without a heartbeat after which the coordinator reports a VM as silent.')
param heartbeatTimeoutSeconds int

@description('Seconds without a good IMDS poll, as a heartbeat reports it, after which the coordinator raises the VM\'s imds-failing card.')
param imdsFailingSeconds int

@description('Remote acknowledge through the Maintenance RP (preview): off, rules (rules with callback: remote-acknowledge), fallback (also approvals no VM listener can execute).')
@allowed([
  'off'
  'rules'
  'fallback'
])
param remoteAcknowledge string


@description('Decide and log but never send approvals.')
param dryRun bool

@description('Suspend a scale set\'s automatic repairs while a Reboot, Redeploy or Freeze is in flight on its VMs (vmss.bicep grants the role when on).')
param suspendRepairs bool

@description('Maximum instances the plan scales out to.')
@minValue(40)
@maxValue(1000)
param maximumInstanceCount int

@description('Memory of each instance.')
@allowed([
  512
  2048
  4096
])
param instanceMemoryMB int

resource appInsights 'Microsoft.Insights/components@2020-02-02' existing = {
  name: appInsightsName
}

resource plan 'Microsoft.Web/serverfarms@2024-04-01' = {
  // checkov:skip=CKV_AZURE_225:Flex Consumption zone redundancy exists only in some regions; the coordinator is stateless (state in zone-redundant storage) and Event Hubs keeps envelopes while an instance is replaced
  name: '${namePrefix}-plan'
  location: location
  tags: tags
  kind: 'functionapp'
  sku: {
    name: 'FC1'
    tier: 'FlexConsumption'
  }
  properties: {
    reserved: true
  }
}

resource site 'Microsoft.Web/sites@2024-04-01' = {
  // checkov:skip=CKV_AZURE_222:the manual-approval link in Teams cards is an HTTP trigger people open from a browser; it needs a public endpoint, and every request must pass Entra ID sign-in (authSettings below); docs/deploy.md describes the private variant
  // checkov:skip=CKV_AZURE_17:client certificates would block the browser-opened manual-approval link; every HTTP request passes Entra ID sign-in instead (authSettings below)
  // checkov:skip=CKV_AZURE_212:Flex Consumption scales from zero on Event Hubs backlog; always-ready instances are optional cost, and envelopes wait in Event Hubs meanwhile
  // checkov:skip=CKV_AZURE_213:the coordinator has no HTTP endpoint whose health reflects the Event Hubs pipeline; its liveness is watched through the cards it sends, the cards-failing alert and Application Insights
  name: '${namePrefix}-coordinator-${uniqueString(resourceGroup().id)}'
  location: location
  tags: tags
  kind: 'functionapp,linux'
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${identityId}': {}
      '${signInIdentityId}': {}
    }
  }
  properties: {
    serverFarmId: plan.id
    httpsOnly: true
    clientCertEnabled: false
    // Key Vault references resolve with the user-assigned identity (default would be a system identity).
    keyVaultReferenceIdentity: identityId
    siteConfig: {
      minTlsVersion: '1.2'
      ftpsState: 'Disabled'
      http20Enabled: true
      remoteDebuggingEnabled: false
    }
    functionAppConfig: {
      deployment: {
        storage: {
          type: 'blobContainer'
          value: deploymentContainerUrl
          authentication: {
            type: 'UserAssignedIdentity'
            userAssignedIdentityResourceId: identityId
          }
        }
      }
      scaleAndConcurrency: {
        maximumInstanceCount: maximumInstanceCount
        instanceMemoryMB: instanceMemoryMB
      }
      runtime: {
        name: 'python'
        version: '3.11'
      }
    }
  }
}

// No publishing passwords: deploy with Entra ID (az functionapp deployment / func publish use it).
resource ftpPublishing 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: site
  name: 'ftp'
  properties: {
    allow: false
  }
}

resource scmPublishing 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: site
  name: 'scm'
  properties: {
    allow: false
  }
}

// All app settings in one resource (it replaces the whole set): a child of the site can use the site's own
// default host name, which the manual-approval links in Teams cards need.
resource appSettings 'Microsoft.Web/sites/config@2024-04-01' = {
  // checkov:skip=CKV_AZURE_13:the check reads a v1 'authsettings' document and fails every other sites/config resource; this one is the app-settings document, and authentication is the authsettingsV2 resource below (project check CKV_SE_7)
  // checkov:skip=CKV_AZURE_222:site-configuration check misapplied to the app-settings document; public access is decided on the site (skip and reason there)
  // checkov:skip=CKV_AZURE_63:site-configuration check (HTTP logging) misapplied to the app-settings document; Functions logs go to Application Insights
  // checkov:skip=CKV_AZURE_65:site-configuration check (detailed error messages) misapplied to the app-settings document; off by default on the site
  // checkov:skip=CKV_AZURE_66:site-configuration check (failed request tracing) misapplied to the app-settings document; Functions traces go to Application Insights
  // checkov:skip=CKV_AZURE_80:site-configuration check (.NET version) misapplied to the app-settings document; the runtime is Python 3.11 (functionAppConfig)
  // checkov:skip=CKV_AZURE_88:site-configuration check (Azure Files) misapplied to the app-settings document; Flex Consumption mounts no file share
  parent: site
  name: 'appsettings'
  properties: {
    // Host storage, identity-based (blob: leases, timer monitor, Event Hubs checkpoints; queue: the delivery queue's
    // trigger).
    AzureWebJobsStorage__credential: 'managedidentity'
    AzureWebJobsStorage__clientId: identityClientId
    AzureWebJobsStorage__blobServiceUri: blobEndpoint
    AzureWebJobsStorage__queueServiceUri: queueEndpoint
    // Event Hubs trigger connection "EventHubConnection" and its binding expressions (function_app.py).
    EventHubConnection__fullyQualifiedNamespace: eventHubNamespace
    EventHubConnection__credential: 'managedidentity'
    EventHubConnection__clientId: identityClientId
    EVENTHUB_NAME: eventHubName
    PLATFORM_EVENTHUB_NAME: platformEventHubName
    EVENTHUB_CONSUMER_GROUP: consumerGroupName
    // Application Insights: the connection string carries no secret here because the component has local auth
    // disabled; telemetry is accepted only with the identity's Entra token.
    APPLICATIONINSIGHTS_CONNECTION_STRING: appInsights.properties.ConnectionString
    APPLICATIONINSIGHTS_AUTHENTICATION_STRING: 'ClientId=${identityClientId};Authorization=AAD'
    // DefaultAzureCredential picks the user-assigned identity.
    AZURE_CLIENT_ID: identityClientId
    // The coordinator (coordinator/settings.py, COORDINATOR_<FIELD>).
    COORDINATOR_TABLE_ENDPOINT: tableEndpoint
    COORDINATOR_STATE_TABLE: stateTableName
    COORDINATOR_MANAGED_IDENTITY_CLIENT_ID: identityClientId
    COORDINATOR_DRY_RUN: dryRun ? 'true' : 'false'
    COORDINATOR_TEAMS_WEBHOOK_URL: '@Microsoft.KeyVault(SecretUri=${teamsUrlEntryUri})'
    COORDINATOR_PUBLIC_BASE_URL: 'https://${site.properties.defaultHostName}'
    COORDINATOR_LOGS_INGESTION_ENDPOINT: logsIngestionEndpoint
    COORDINATOR_LOGS_DCR_IMMUTABLE_ID: historyDcrImmutableId
    COORDINATOR_LOGS_STREAM: historyStreamName
    COORDINATOR_RELAY_NAMESPACE: relayNamespace
    COORDINATOR_RELAY_SUBSCRIPTION_ID: subscription().subscriptionId
    COORDINATOR_RELAY_RESOURCE_GROUP: resourceGroup().name
    // The census (budgets, tag rules) is read from ARM in this resource group, where the scale set and, in Flexible
    // mode, its VMs are (vmss.bicep grants the read).
    COORDINATOR_CENSUS_RESOURCE_GROUPS: resourceGroup().id
    COORDINATOR_SUSPEND_REPAIRS: suspendRepairs ? 'true' : 'false'
    COORDINATOR_HEARTBEAT_TIMEOUT_SECONDS: string(heartbeatTimeoutSeconds)
    COORDINATOR_IMDS_FAILING_SECONDS: string(imdsFailingSeconds)
    COORDINATOR_REMOTE_ACKNOWLEDGE: remoteAcknowledge
    // Approvals not answered within a run's few seconds continue through this queue (function_app.continue_approval,
    // on the host storage connection above).
    COORDINATOR_DELIVERY_QUEUE_URL: deliveryQueueUrl
    // App Service Authentication: the sign-in identity's client id stands in for a client secret (the app
    // registration holds a federated credential for it), and only accounts of the one tenant are accepted.
    OVERRIDE_USE_MI_FIC_ASSERTION_CLIENTID: signInIdentityClientId
    WEBSITE_AUTH_AAD_ALLOWED_TENANTS: signInTenantId
  }
}

// Entra ID sign-in in front of every HTTP request (App Service Authentication, "Easy Auth"). Unauthenticated
// requests are sent to the sign-in page rather than answered 401: the approval link in a Teams card opens in a
// browser, which must land on the sign-in page; an API caller brings a bearer token and is signed in, and one
// without a token gets a redirect, never data. The platform then passes the person's claims (including app roles)
// in X-MS-CLIENT-PRINCIPAL, and coordinator/http.py requires the app roles.
resource authSettings 'Microsoft.Web/sites/config@2024-04-01' = {
  // checkov:skip=CKV_AZURE_13:the check reads 'properties.enabled' of a v1 'authsettings' document; this is authsettingsV2, where the switch is platform.enabled (true) with requireAuthentication (true); project check CKV_SE_7 checks it
  // checkov:skip=CKV_AZURE_222:site-configuration check misapplied to the authentication document; public access is decided on the site (skip and reason there)
  // checkov:skip=CKV_AZURE_63:site-configuration check (HTTP logging) misapplied to the authentication document; Functions logs go to Application Insights
  // checkov:skip=CKV_AZURE_65:site-configuration check (detailed error messages) misapplied to the authentication document; off by default on the site
  // checkov:skip=CKV_AZURE_66:site-configuration check (failed request tracing) misapplied to the authentication document; Functions traces go to Application Insights
  // checkov:skip=CKV_AZURE_80:site-configuration check (.NET version) misapplied to the authentication document; the runtime is Python 3.11 (functionAppConfig)
  // checkov:skip=CKV_AZURE_88:site-configuration check (Azure Files) misapplied to the authentication document; Flex Consumption mounts no file share
  parent: site
  name: 'authsettingsV2'
  properties: {
    platform: {
      enabled: true
    }
    globalValidation: {
      requireAuthentication: true
      unauthenticatedClientAction: 'RedirectToLoginPage'
      redirectToProvider: 'azureactivedirectory'
    }
    identityProviders: {
      azureActiveDirectory: {
        enabled: true
        registration: {
          clientId: signInClientId
          openIdIssuer: '${environment().authentication.loginEndpoint}${signInTenantId}/v2.0'
          // Not a secret: the name of the app setting holding the sign-in identity's client id (see above).
          clientSecretSettingName: 'OVERRIDE_USE_MI_FIC_ASSERTION_CLIENTID'
        }
        validation: {
          allowedAudiences: [
            'api://${signInClientId}'
            signInClientId
          ]
        }
      }
    }
    login: {
      // The app calls no API on the person's behalf: keep no tokens.
      tokenStore: {
        enabled: false
      }
    }
    httpSettings: {
      requireHttps: true
    }
  }
}

output functionAppName string = site.name
output functionAppHostName string = site.properties.defaultHostName
