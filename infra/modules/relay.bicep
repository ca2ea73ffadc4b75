// Azure Relay namespace for approvals (coordinator -> VM). Hybrid connections are NOT declared here: the
// coordinator creates one per VM when it first sees the VM and deletes it when the VM is gone (a connection
// spreads requests among up to 25 listeners at random, so a shared one cannot address a single VM).
// Relay has no disableLocalAuth switch (not in the Microsoft.Relay 2024-01-01 types, nor in 2026-01-01 or
// 2026-07-01-preview): no authorization rule is declared and none is ever listed, and scripts/deploy.sh deletes
// the namespace's built-in RootManageSharedAccessKey after each deployment and fails if any SAS rule is left.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Principal id of the coordinator identity (manages hybrid connections, sends approvals).')
param coordinatorPrincipalId string

@description('Principal id of the forwarders\' identity (listens).')
param vmPrincipalId string

var roles = loadJsonContent('../roles.json')

resource namespace 'Microsoft.Relay/namespaces@2024-01-01' = {
  name: '${namePrefix}-relay-${uniqueString(resourceGroup().id)}'
  location: location
  tags: tags
  sku: {
    name: 'Standard'
    tier: 'Standard'
  }
  properties: {
    publicNetworkAccess: 'Enabled'
  }
}

// Custom role, because the narrowest built-in that can create hybrid connections (Azure Relay Owner) also
// grants every data action (listen on any VM's connection) and namespace management. This one can only read,
// create/update and delete hybrid connections, and only in this resource group.
resource hybridConnectionManager 'Microsoft.Authorization/roleDefinitions@2022-04-01' = {
  name: guid(resourceGroup().id, 'scheduled-events-hybrid-connection-manager')
  properties: {
    roleName: 'Scheduled Events Hybrid Connection Manager (${resourceGroup().name})'
    description: 'Create, read and delete Azure Relay hybrid connections; no data-plane rights, no keys.'
    type: 'CustomRole'
    assignableScopes: [
      resourceGroup().id
    ]
    permissions: [
      {
        actions: [
          'Microsoft.Relay/namespaces/read'
          'Microsoft.Relay/namespaces/hybridConnections/read'
          'Microsoft.Relay/namespaces/hybridConnections/write'
          'Microsoft.Relay/namespaces/hybridConnections/delete'
        ]
        notActions: []
        dataActions: []
        notDataActions: []
      }
    ]
  }
}

// The custom role on this namespace only: the coordinator manages the per-VM hybrid connections.
resource coordinatorManager 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(namespace.id, coordinatorPrincipalId, hybridConnectionManager.id)
  scope: namespace
  properties: {
    roleDefinitionId: hybridConnectionManager.id
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Relay Sender at namespace scope: the target connections do not exist at deployment time.
resource coordinatorSender 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(namespace.id, coordinatorPrincipalId, roles.relaySender.id)
  scope: namespace
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.relaySender.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Relay Listener at namespace scope: each VM's connection is created at run time, and granting per connection
// would need the coordinator to hold User Access Administrator. The residual risk (a VM could listen on
// another VM's connection) is bounded by the listener, which approves only EventIds in its own IMDS document.
resource vmListener 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(namespace.id, vmPrincipalId, roles.relayListener.id)
  scope: namespace
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.relayListener.id)
    principalId: vmPrincipalId
    principalType: 'ServicePrincipal'
  }
}

output namespaceName string = namespace.name
// Host name from the service's own endpoint (https://<name>.servicebus.windows.net:443/), not a hard-coded cloud suffix.
output fullyQualifiedNamespace string = replace(replace(namespace.properties.serviceBusEndpoint, 'https://', ''), ':443/', '')
output hybridConnectionManagerRoleId string = hybridConnectionManager.id
