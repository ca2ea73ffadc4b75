// The forwarder package the VMs download and install as root, in its own storage account: the coordinator's
// identity holds Storage Blob Data Owner on the coordinator's account (the Functions host needs it), so a package
// kept there could be rewritten by anyone who takes over the coordinator. Here the VMs may only read, the
// coordinator has no role at all, and only the person deploying uploads (scripts/deploy.sh grants that person
// Storage Blob Data Contributor on the one container). The VMs also check the package's SHA-256 from the
// deployment (cloud-init) before installing it.
@description('Azure region.')
param location string

@description('Prefix of every resource name (letters and digits are used for the account name).')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Principal id of the forwarders\' identity (downloads the package).')
param vmPrincipalId string

var roles = loadJsonContent('../roles.json')
var accountName = take('${toLower(replace(namePrefix, '-', ''))}pkg${uniqueString(resourceGroup().id)}', 24)

resource account 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  // checkov:skip=CKV_AZURE_35:the VMs (through NAT) and the person deploying reach it over the public endpoint; shared keys are off and every caller needs an Entra role on the one container
  // checkov:skip=CKV_AZURE_59:same reason as CKV_AZURE_35; anonymous blob access is off (allowBlobPublicAccess false)
  // checkov:skip=CKV_AZURE_206:ZRS is the replication; the package is rebuilt from the repository by scripts/deploy.sh, geo-replication buys nothing
  // checkov:skip=CKV_AZURE_43:the name is computed (take(prefix + pkg + uniqueString, 24), lower-case letters and digits) and checkov cannot evaluate it
  // checkov:skip=CKV_AZURE_33:the account holds blobs only (no queue service is used), so there is no queue to log
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
    // Every upload stays as a version: which package a VM installed can be found afterwards.
    isVersioningEnabled: true
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

resource forwarderContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: 'forwarder'
  properties: {
    publicAccess: 'None'
  }
}

// Blob Data Reader on the forwarder container only: the VMs can fetch the package and nothing else.
resource forwarderReader 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(forwarderContainer.id, vmPrincipalId, roles.storageBlobDataReader.id)
  scope: forwarderContainer
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.storageBlobDataReader.id)
    principalId: vmPrincipalId
    principalType: 'ServicePrincipal'
  }
}

output accountName string = account.name
output forwarderContainerUrl string = '${account.properties.primaryEndpoints.blob}${forwarderContainer.name}'
