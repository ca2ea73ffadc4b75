// The coordinator's storage account: the Functions host (identity-based AzureWebJobsStorage), the Flex Consumption
// deployment package and the coordinator's state tables. The forwarder package the VMs install is NOT here
// (packages.bicep): the coordinator holds Blob Data Owner on this account.
// Shared keys are off: every client (host, coordinator) authenticates with Entra ID.
@description('Azure region.')
param location string

@description('Prefix of every resource name (letters and digits are used for the account name).')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Tables the coordinator keeps its state in.')
param stateTableNames array

@description('Principal id of the coordinator identity.')
param coordinatorPrincipalId string

var roles = loadJsonContent('../roles.json')
// The delivery queue's name, as function_app.py's queue trigger and coordinator/adapters/delivery_queue.py name it.
var deliveryQueueName = 'approval-deliveries'
var accountName = take('${toLower(replace(namePrefix, '-', ''))}st${uniqueString(resourceGroup().id)}', 24)

resource account 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  // checkov:skip=CKV_AZURE_35:Flex Consumption without VNet integration and the VMs (through NAT) reach storage over public endpoints; shared keys are off and every caller needs an Entra role
  // checkov:skip=CKV_AZURE_59:same reason as CKV_AZURE_35; blob public (anonymous) access is off (allowBlobPublicAccess false)
  // checkov:skip=CKV_AZURE_206:ZRS is the replication; geo-replicating host leases, checkpoints and re-creatable fleet state buys nothing
  // checkov:skip=CKV_AZURE_43:the name is computed (take(prefix + st + uniqueString, 24), lower-case letters and digits) and checkov cannot evaluate it
  name: accountName
  location: location
  tags: tags
  kind: 'StorageV2'
  sku: {
    name: 'Standard_ZRS'
  }
  properties: {
    accessTier: 'Hot'
    allowBlobPublicAccess: false
    allowSharedKeyAccess: false
    defaultToOAuthAuthentication: true
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    publicNetworkAccess: 'Enabled'
    networkAcls: {
      bypass: 'AzureServices'
      defaultAction: 'Allow'
    }
  }
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' = {
  parent: account
  name: 'default'
  properties: {
    deleteRetentionPolicy: {
      enabled: true
      days: 7
    }
    containerDeleteRetentionPolicy: {
      enabled: true
      days: 7
    }
  }
}

// Flex Consumption reads the app package from here with the coordinator identity.
resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: 'app-package'
  properties: {
    publicAccess: 'None'
  }
}

resource tableService 'Microsoft.Storage/storageAccounts/tableServices@2023-05-01' = {
  parent: account
  name: 'default'
}

resource stateTables 'Microsoft.Storage/storageAccounts/tableServices/tables@2023-05-01' = [for tableName in stateTableNames: {
  parent: tableService
  name: tableName
}]

resource queueService 'Microsoft.Storage/storageAccounts/queueServices@2023-05-01' = {
  parent: account
  name: 'default'
}

// Approvals a batch, tick or person's approval could not deliver within its few seconds continue through the
// delivery queue (coordinator/adapters/delivery_queue.py, function_app.continue_approval); the Functions host moves
// a message whose invocations kept failing to the poison queue (host.json maxDequeueCount).
resource deliveryQueues 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = [for queueName in [deliveryQueueName, '${deliveryQueueName}-poison']: {
  parent: queueService
  name: queueName
}]

// Blob Data Owner on the account: the Functions host creates its own containers (leases, checkpoints) at run
// time and reads the deployment package; documented requirement for identity-based AzureWebJobsStorage.
resource hostBlobOwner 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(account.id, coordinatorPrincipalId, roles.storageBlobDataOwner.id)
  scope: account
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageBlobDataOwner.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Table Data Contributor on each state table only, not the account.
resource stateTableContributor 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for i in range(0, length(stateTableNames)): {
  name: guid(stateTables[i].id, coordinatorPrincipalId, roles.storageTableDataContributor.id)
  scope: stateTables[i]
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageTableDataContributor.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}]

// Queue Data Contributor on the two delivery queues only, not the account: the coordinator puts what a run hands
// over; its Functions host's queue trigger (the same identity) reads, deletes and sets aside.
resource deliveryQueueContributor 'Microsoft.Authorization/roleAssignments@2022-04-01' = [for i in range(0, 2): {
  name: guid(deliveryQueues[i].id, coordinatorPrincipalId, roles.storageQueueDataContributor.id)
  scope: deliveryQueues[i]
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageQueueDataContributor.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}]

output accountName string = account.name
output blobEndpoint string = account.properties.primaryEndpoints.blob
output queueEndpoint string = account.properties.primaryEndpoints.queue
output deliveryQueueUrl string = '${account.properties.primaryEndpoints.queue}${deliveryQueueName}'
output tableEndpoint string = account.properties.primaryEndpoints.table
output deploymentContainerUrl string = '${account.properties.primaryEndpoints.blob}${deploymentContainer.name}'
