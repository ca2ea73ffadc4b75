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

@description('Storage account blob endpoint (host storage).')
param blobEndpoint string

@description('Storage account queue endpoint (host storage).')
param queueEndpoint string

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

@description('Stream name of the history DCR.')
param historyStreamName string

@description('Key Vault URI of the Teams Workflows URL secret (a reference, not the value).')
param teamsSecretUri string

@description('Seconds without a heartbeat after which the coordinator reports a VM as silent.')
param heartbeatTimeoutSeconds int

@description('Decide and log but never send approvals.')
param dryRun bool

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
  // checkov:skip=CKV_AZURE_222:the manual-approval link in Teams cards is an HTTP trigger people open from a browser; it needs a public endpoint (function-level auth); docs/deploy.md has the private variant
  // checkov:skip=CKV_AZURE_17:client certificates would block the browser-opened manual-approval link; callers authenticate with function keys or Entra ID
  // checkov:skip=CKV_AZURE_212:Flex Consumption scales from zero on Event Hubs backlog; always-ready instances are optional cost, and envelopes wait in Event Hubs meanwhile
  // checkov:skip=CKV_AZURE_213:the App Service health check is not available on Flex Consumption; liveness is watched through the heartbeat and approval alerts
  name: '${namePrefix}-coordinator-${uniqueString(resourceGroup().id)}'
  location: location
  tags: tags
  kind: 'functionapp,linux'
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${identityId}': {}
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
      appSettings: [
        // Host storage, identity-based.
        {
          name: 'AzureWebJobsStorage__credential'
          value: 'managedidentity'
        }
        {
          name: 'AzureWebJobsStorage__clientId'
          value: identityClientId
        }
        {
          name: 'AzureWebJobsStorage__blobServiceUri'
          value: blobEndpoint
        }
        {
          name: 'AzureWebJobsStorage__queueServiceUri'
          value: queueEndpoint
        }
        // Event Hubs trigger connection "EventHubConnection", identity-based.
        {
          name: 'EventHubConnection__fullyQualifiedNamespace'
          value: eventHubNamespace
        }
        {
          name: 'EventHubConnection__credential'
          value: 'managedidentity'
        }
        {
          name: 'EventHubConnection__clientId'
          value: identityClientId
        }
        // Application Insights: the connection string carries no secret here because the component has local
        // auth disabled; telemetry is accepted only with the identity's Entra token.
        {
          name: 'APPLICATIONINSIGHTS_CONNECTION_STRING'
          value: appInsights.properties.ConnectionString
        }
        {
          name: 'APPLICATIONINSIGHTS_AUTHENTICATION_STRING'
          value: 'ClientId=${identityClientId};Authorization=AAD'
        }
        // DefaultAzureCredential in the coordinator picks the user-assigned identity.
        {
          name: 'AZURE_CLIENT_ID'
          value: identityClientId
        }
        // Coordinator settings (coordinator/settings.py).
        {
          name: 'SE_EVENTHUB_NAME'
          value: eventHubName
        }
        {
          name: 'SE_EVENTHUB_CONSUMER_GROUP'
          value: consumerGroupName
        }
        {
          name: 'SE_STATE_TABLE_ENDPOINT'
          value: tableEndpoint
        }
        {
          name: 'SE_STATE_TABLE_NAME'
          value: stateTableName
        }
        {
          name: 'SE_RELAY_NAMESPACE'
          value: relayNamespace
        }
        {
          name: 'SE_LOGS_INGESTION_ENDPOINT'
          value: logsIngestionEndpoint
        }
        {
          name: 'SE_LOGS_DCR_IMMUTABLE_ID'
          value: historyDcrImmutableId
        }
        {
          name: 'SE_LOGS_STREAM_NAME'
          value: historyStreamName
        }
        {
          name: 'SE_TEAMS_WEBHOOK_URL'
          value: '@Microsoft.KeyVault(SecretUri=${teamsSecretUri})'
        }
        {
          name: 'SE_HEARTBEAT_TIMEOUT_SECONDS'
          value: string(heartbeatTimeoutSeconds)
        }
        {
          name: 'SE_DRY_RUN'
          value: string(dryRun)
        }
      ]
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

output functionAppName string = site.name
output functionAppHostName string = site.properties.defaultHostName
