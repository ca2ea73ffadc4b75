// Event Hubs namespace, the envelope hub, the platform's hub (Event Grid's own channel) and the coordinator's consumer
// group on each. Entra ID only: SAS keys are disabled on the namespace, so no connection string exists that could leak.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Name of the event hub that carries the envelopes.')
param hubName string

@description('Name of the event hub that carries Event Grid\'s scheduled events: only the system topic may send to it.')
param platformHubName string

@description('Partitions of the hub; the partition key is the VM resource id, so more partitions spread more VMs.')
@minValue(1)
@maxValue(32)
param partitionCount int

@description('Days an envelope stays in the hub (Standard tier: 1 to 7).')
@minValue(1)
@maxValue(7)
param retentionDays int

@description('Consumer group of the coordinator.')
param consumerGroupName string

@description('Principal id of the forwarders\' identity (sends).')
param vmPrincipalId string

@description('Principal id of the coordinator identity (receives).')
param coordinatorPrincipalId string

@description('Preview: route Event Grid\'s scheduled events (system topic Microsoft.ResourceNotifications.MaintenanceResources of this subscription) to the hub.')
param enableEventGridSource bool

var roles = loadJsonContent('../roles.json')

resource namespace 'Microsoft.EventHub/namespaces@2024-01-01' = {
  name: '${namePrefix}-ehns-${uniqueString(resourceGroup().id)}'
  location: location
  tags: tags
  // Standard: Basic has no consumer groups beyond $Default.
  sku: {
    name: 'Standard'
    tier: 'Standard'
    capacity: 1
  }
  properties: {
    disableLocalAuth: true
    minimumTlsVersion: '1.2'
    publicNetworkAccess: 'Enabled'
    isAutoInflateEnabled: false
  }
}

resource hub 'Microsoft.EventHub/namespaces/eventhubs@2024-01-01' = {
  parent: namespace
  name: hubName
  properties: {
    partitionCount: partitionCount
    messageRetentionInDays: retentionDays
  }
}

resource consumerGroup 'Microsoft.EventHub/namespaces/eventhubs/consumergroups@2024-01-01' = {
  parent: hub
  name: consumerGroupName
  properties: {
    userMetadata: 'Scheduled-events coordinator (Azure Functions Event Hubs trigger).'
  }
}

// Event Grid's own channel: the platform's events arrive here, never on the hub every VM can send to, so the coordinator
// knows a fact came from the platform (an Event Grid event on the envelopes' hub is dead-lettered as forged). Always
// created, so the coordinator's second trigger always has its hub; Event Grid events are few (one per status change).
resource platformHub 'Microsoft.EventHub/namespaces/eventhubs@2024-01-01' = {
  parent: namespace
  name: platformHubName
  properties: {
    partitionCount: 2
    messageRetentionInDays: retentionDays
  }
}

resource platformConsumerGroup 'Microsoft.EventHub/namespaces/eventhubs/consumergroups@2024-01-01' = {
  parent: platformHub
  name: consumerGroupName
  properties: {
    userMetadata: 'Scheduled-events coordinator (Azure Functions Event Hubs trigger for Event Grid events).'
  }
}

// Data Sender on this hub only: the forwarders publish envelopes and can neither read nor manage anything.
resource vmSender 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(hub.id, vmPrincipalId, roles.eventHubsDataSender.id)
  scope: hub
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.eventHubsDataSender.id)
    principalId: vmPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Data Receiver on this hub: hub scope, not consumer-group scope, because the Python trigger then fails with
// "'Listen' claim(s) are required" (Azure/azure-functions-python-worker#1778).
resource coordinatorReceiver 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(hub.id, coordinatorPrincipalId, roles.eventHubsDataReceiver.id)
  scope: hub
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.eventHubsDataReceiver.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Data Receiver on the platform's hub: the coordinator's second trigger (function_app.ingest_platform_events).
resource coordinatorPlatformReceiver 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(platformHub.id, coordinatorPrincipalId, roles.eventHubsDataReceiver.id)
  scope: platformHub
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.eventHubsDataReceiver.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Event Grid as a source (preview): the subscription's Maintenance resources system topic (one per subscription and
// topic type; location global), with its own identity, so that delivery to the hub needs no key.
resource maintenanceTopic 'Microsoft.EventGrid/systemTopics@2025-02-15' = if (enableEventGridSource) {
  name: '${namePrefix}-maintenance-events'
  location: 'global'
  tags: tags
  identity: {
    type: 'SystemAssigned'
  }
  properties: {
    source: subscription().id
    topicType: 'Microsoft.ResourceNotifications.MaintenanceResources'
  }
}

// Data Sender on the platform's hub only, for the system topic's identity alone: Event Grid delivers scheduled events
// there (deliveryWithResourceIdentity) and can neither read nor manage anything; no VM may send there.
resource topicSender 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (enableEventGridSource) {
  name: guid(platformHub.id, 'maintenance-events-topic', roles.eventHubsDataSender.id)
  scope: platformHub
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.eventHubsDataSender.id)
    principalId: maintenanceTopic!.identity.principalId
    principalType: 'ServicePrincipal'
  }
}

// The name is kept from when it delivered to the envelopes' hub, so a redeployment moves that subscription to the
// platform's hub instead of leaving it delivering to the old one beside a new one.
resource maintenanceToHub 'Microsoft.EventGrid/systemTopics/eventSubscriptions@2025-02-15' = if (enableEventGridSource) {
  parent: maintenanceTopic
  name: 'scheduled-events-to-hub'
  dependsOn: [
    topicSender
  ]
  properties: {
    eventDeliverySchema: 'EventGridSchema'
    filter: {
      includedEventTypes: [
        'Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted'
      ]
    }
    deliveryWithResourceIdentity: {
      identity: {
        type: 'SystemAssigned'
      }
      destination: {
        endpointType: 'EventHub'
        properties: {
          resourceId: platformHub.id
        }
      }
    }
  }
}

output namespaceName string = namespace.name
// Host name from the service's own endpoint (https://<name>.servicebus.windows.net:443/), not a hard-coded cloud suffix.
output fullyQualifiedNamespace string = replace(replace(namespace.properties.serviceBusEndpoint, 'https://', ''), ':443/', '')
output hubName string = hub.name
output platformHubName string = platformHub.name
output consumerGroupName string = consumerGroup.name
