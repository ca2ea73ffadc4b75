// Scheduled events for a fleet: the scale set with its forwarders, Event Hubs, the coordinator (Functions, Flex
// Consumption), Azure Relay for approvals, the history table in Log Analytics, alerts to Teams and a workbook.
// Deploy: az deployment group create -g <rg> -f infra/main.bicep -p infra/main.bicepparam  (docs/deploy.md)
targetScope = 'resourceGroup'

@description('Azure region of every resource (default: the resource group\'s).')
param location string = resourceGroup().location

@description('Prefix of every resource name: 3 to 11 lower-case letters, digits or hyphens.')
@minLength(3)
@maxLength(11)
param namePrefix string

@description('Tags applied to every resource.')
param tags object = {
  workload: 'scheduled-events'
}

// --- Scale set -------------------------------------------------------------------------------------------------
@description('Scale-set orchestration mode.')
@allowed([
  'Uniform'
  'Flexible'
])
param orchestrationMode string = 'Flexible'

@description('Number of instances (0 on the first deployment, before the forwarder package is uploaded).')
@minValue(0)
@maxValue(1000)
param instanceCount int = 2

@description('VM size of the instances.')
param vmSize string = 'Standard_D2s_v5'

@description('Local administrator of the instances (SSH key only).')
param adminUsername string

@description('OpenSSH public key of the administrator.')
param sshPublicKey string

@description('Notice of a Terminate (delete/scale-in) event: ISO 8601 duration, 5 to 15 minutes.')
@allowed([
  'PT5M'
  'PT6M'
  'PT7M'
  'PT8M'
  'PT9M'
  'PT10M'
  'PT11M'
  'PT12M'
  'PT13M'
  'PT14M'
  'PT15M'
])
param terminateNotBeforeTimeout string = 'PT10M'

@description('Announce OS image upgrades/reimages as scheduled events.')
param enableOsImageNotification bool = false

@description('Preview: also publish scheduled events to Event Grid / Azure Resource Graph (feature registration needed), and route the system topic Microsoft.ResourceNotifications.MaintenanceResources to the envelopes\' event hub (one such system topic per subscription).')
param enableEventGridPublishing bool = false

@description('Preview: approve through the Maintenance RP\'s acknowledge, unverified by any VM (docs/security.md): off, rules (rules with callback: remote-acknowledge), fallback (also approvals no VM listener can execute, e.g. VMs without the forwarder).')
@allowed([
  'off'
  'rules'
  'fallback'
])
param remoteAcknowledge string = 'off'

@description('Let the coordinator suspend a scale set\'s automatic repairs while an approved Reboot, Redeploy or Freeze is in flight on its VMs, and resume them after (else a maintenance reboot counts as a failed instance and is replaced): the custom Scheduled Events Repairs Operator role (scale set read, setOrchestrationServiceState) on this resource group. false: no such role.')
param suspendAutomaticRepairs bool = true

@description('URL of the forwarder package (tar.gz with forwarder/install.sh). Empty: forwarder.tar.gz in this deployment\'s package account ("forwarder" container), fetched with the VM identity.')
param forwarderPackageUrl string = ''

@description('SHA-256 (hex) of the forwarder package: instances refuse to install anything else (scripts/deploy.sh computes it).')
@minLength(64)
@maxLength(64)
param forwarderPackageSha256 string

@description('Seconds between forwarder heartbeats.')
@minValue(10)
@maxValue(3600)
param heartbeatSeconds int = 60

// --- Event Hubs ------------------------------------------------------------------------------------------------
@description('Partitions of the envelope hub.')
@minValue(1)
@maxValue(32)
param eventHubPartitionCount int = 4

@description('Days an envelope stays in the hub.')
@minValue(1)
@maxValue(7)
param eventHubRetentionDays int = 1

// --- Coordinator -----------------------------------------------------------------------------------------------
@description('Maximum instances of the Functions app.')
@minValue(40)
@maxValue(1000)
param functionMaximumInstanceCount int = 40

@description('Memory of each Functions instance (MB).')
@allowed([
  512
  2048
  4096
])
param functionInstanceMemoryMB int = 2048

@description('Decide and log but never send approvals (start here, then switch off).')
param dryRun bool = true

@description('Seconds without a heartbeat after which the coordinator reports a VM as silent.')
@minValue(60)
param heartbeatTimeoutSeconds int = 300

@description('Seconds without a good IMDS poll, as a heartbeat reports it, after which the coordinator raises the VM\'s imds-failing card.')
@minValue(5)
param imdsFailingSeconds int = 60

@description('Days the history table keeps rows.')
@minValue(4)
@maxValue(730)
param historyRetentionDays int = 90

@description('Application (client) id of the Entra app registration people sign in with to approve (scripts/entra-app.sh creates it; app roles ScheduledEvents.Approve and ScheduledEvents.Read).')
@minLength(36)
@maxLength(36)
param signInClientId string

@description('Entra tenant of that app registration (default: the deployment\'s tenant).')
param signInTenantId string = tenant().tenantId

@secure()
@description('Teams Workflows webhook URL ("When a Teams webhook request is received"). Stored in Key Vault only.')
param teamsWorkflowUrl string

// The one definition of the history table (path relative to this file).
var historySchema = loadJsonContent('../coordinator/history_columns.json')
var eventHubName = 'scheduled-events'
var platformHubName = 'scheduled-events-platform'
var consumerGroupName = 'coordinator'
var stateTableName = 'scheduledevents'

module identities 'modules/identities.bicep' = {
  name: 'identities'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
  }
}

module network 'modules/network.bicep' = {
  name: 'network'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
  }
}

module monitoring 'modules/monitoring.bicep' = {
  name: 'monitoring'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    historySchema: historySchema
    historyRetentionDays: historyRetentionDays
    coordinatorPrincipalId: identities.outputs.coordinatorIdentityPrincipalId
  }
}

module eventHubs 'modules/eventhubs.bicep' = {
  name: 'eventhubs'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    hubName: eventHubName
    platformHubName: platformHubName
    partitionCount: eventHubPartitionCount
    retentionDays: eventHubRetentionDays
    consumerGroupName: consumerGroupName
    vmPrincipalId: identities.outputs.vmIdentityPrincipalId
    coordinatorPrincipalId: identities.outputs.coordinatorIdentityPrincipalId
    enableEventGridSource: enableEventGridPublishing
  }
}

module storage 'modules/storage.bicep' = {
  name: 'storage'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    stateTableNames: [
      stateTableName
    ]
    coordinatorPrincipalId: identities.outputs.coordinatorIdentityPrincipalId
  }
}

module packages 'modules/packages.bicep' = {
  name: 'packages'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    vmPrincipalId: identities.outputs.vmIdentityPrincipalId
  }
}

module relay 'modules/relay.bicep' = {
  name: 'relay'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    coordinatorPrincipalId: identities.outputs.coordinatorIdentityPrincipalId
    vmPrincipalId: identities.outputs.vmIdentityPrincipalId
  }
}

module keyVault 'modules/keyvault.bicep' = {
  name: 'keyvault'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    teamsWorkflowUrl: teamsWorkflowUrl
    coordinatorPrincipalId: identities.outputs.coordinatorIdentityPrincipalId
  }
}

module functionApp 'modules/functionapp.bicep' = {
  name: 'functionapp'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    identityId: identities.outputs.coordinatorIdentityId
    identityClientId: identities.outputs.coordinatorIdentityClientId
    signInClientId: signInClientId
    signInTenantId: signInTenantId
    signInIdentityId: identities.outputs.signInIdentityId
    signInIdentityClientId: identities.outputs.signInIdentityClientId
    blobEndpoint: storage.outputs.blobEndpoint
    queueEndpoint: storage.outputs.queueEndpoint
    deliveryQueueUrl: storage.outputs.deliveryQueueUrl
    tableEndpoint: storage.outputs.tableEndpoint
    deploymentContainerUrl: storage.outputs.deploymentContainerUrl
    appInsightsName: monitoring.outputs.appInsightsName
    eventHubNamespace: eventHubs.outputs.fullyQualifiedNamespace
    eventHubName: eventHubs.outputs.hubName
    platformEventHubName: eventHubs.outputs.platformHubName
    consumerGroupName: eventHubs.outputs.consumerGroupName
    stateTableName: stateTableName
    relayNamespace: relay.outputs.fullyQualifiedNamespace
    logsIngestionEndpoint: monitoring.outputs.logsIngestionEndpoint
    historyDcrImmutableId: monitoring.outputs.historyDcrImmutableId
    historyStreamName: monitoring.outputs.historyStreamName
    teamsUrlEntryUri: keyVault.outputs.teamsUrlEntryUri
    heartbeatTimeoutSeconds: heartbeatTimeoutSeconds
    imdsFailingSeconds: imdsFailingSeconds
    remoteAcknowledge: remoteAcknowledge
    dryRun: dryRun
    suspendRepairs: suspendAutomaticRepairs
    maximumInstanceCount: functionMaximumInstanceCount
    instanceMemoryMB: functionInstanceMemoryMB
  }
}

module vmss 'modules/vmss.bicep' = {
  name: 'vmss'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    orchestrationMode: orchestrationMode
    instanceCount: instanceCount
    vmSize: vmSize
    adminUsername: adminUsername
    sshPublicKey: sshPublicKey
    terminateNotBeforeTimeout: terminateNotBeforeTimeout
    enableOsImageNotification: enableOsImageNotification
    enableEventGridPublishing: enableEventGridPublishing
    enableRemoteAcknowledge: remoteAcknowledge != 'off'
    enableRepairsSuspension: suspendAutomaticRepairs
    coordinatorPrincipalId: identities.outputs.coordinatorIdentityPrincipalId
    subnetId: network.outputs.subnetId
    vmIdentityId: identities.outputs.vmIdentityId
    vmIdentityClientId: identities.outputs.vmIdentityClientId
    eventHubNamespace: eventHubs.outputs.fullyQualifiedNamespace
    eventHubName: eventHubs.outputs.hubName
    relayNamespace: relay.outputs.fullyQualifiedNamespace
    forwarderPackageUrl: empty(forwarderPackageUrl) ? '${packages.outputs.forwarderContainerUrl}/forwarder.tar.gz' : forwarderPackageUrl
    forwarderPackageSha256: forwarderPackageSha256
    heartbeatSeconds: heartbeatSeconds
  }
}

module alerts 'modules/alerts.bicep' = {
  name: 'alerts'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    workspaceId: monitoring.outputs.workspaceId
    keyVaultName: keyVault.outputs.vaultName
    teamsUrlEntryName: keyVault.outputs.teamsUrlEntryName
  }
}

module workbook 'modules/workbook.bicep' = {
  name: 'workbook'
  params: {
    location: location
    namePrefix: namePrefix
    tags: tags
    workspaceId: monitoring.outputs.workspaceId
  }
}

// What a person needs next: where to publish the app, where to upload the forwarder, what to look at.
output functionAppName string = functionApp.outputs.functionAppName
output functionAppHostName string = functionApp.outputs.functionAppHostName
output storageAccountName string = storage.outputs.accountName
output packageStorageAccountName string = packages.outputs.accountName
output forwarderPackageUrl string = empty(forwarderPackageUrl) ? '${packages.outputs.forwarderContainerUrl}/forwarder.tar.gz' : forwarderPackageUrl
output vmssName string = vmss.outputs.vmssName
output eventHubNamespace string = eventHubs.outputs.fullyQualifiedNamespace
output eventHubName string = eventHubs.outputs.hubName
output relayNamespace string = relay.outputs.fullyQualifiedNamespace
output relayNamespaceName string = relay.outputs.namespaceName
output logsIngestionEndpoint string = monitoring.outputs.logsIngestionEndpoint
output historyDcrImmutableId string = monitoring.outputs.historyDcrImmutableId
output historyStreamName string = monitoring.outputs.historyStreamName
output workspaceName string = monitoring.outputs.workspaceName
output keyVaultName string = keyVault.outputs.vaultName
output workbookId string = workbook.outputs.workbookId
output coordinatorIdentityClientId string = identities.outputs.coordinatorIdentityClientId
output forwarderIdentityClientId string = identities.outputs.vmIdentityClientId
// scripts/entra-app.sh gives the app registration a federated credential for this identity (no client secret).
output signInIdentityPrincipalId string = identities.outputs.signInIdentityPrincipalId
