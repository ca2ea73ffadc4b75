// Key Vault (RBAC-authorized) holding the one secret of the deployment: the Teams Workflows webhook URL (it
// carries a sig= token). Readers get Key Vault Secrets User on that secret only.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@secure()
@description('Teams Workflows "When a Teams webhook request is received" URL; stored as a secret, never output.')
param teamsWorkflowUrl string

@description('Principal id of the coordinator identity (reads the secret through a Key Vault reference).')
param coordinatorPrincipalId string

var roles = loadJsonContent('../roles.json')

resource vault 'Microsoft.KeyVault/vaults@2023-07-01' = {
  // checkov:skip=CKV_AZURE_109:the Logic App (Consumption) and the Functions app without VNet integration read the secret over the public endpoint; access is RBAC-only, scoped to the one secret
  // checkov:skip=CKV_AZURE_189:same reason as CKV_AZURE_109
  name: take('${namePrefix}-kv-${uniqueString(resourceGroup().id)}', 24)
  location: location
  tags: tags
  properties: {
    tenantId: subscription().tenantId
    sku: {
      family: 'A'
      name: 'standard'
    }
    enableRbacAuthorization: true
    enableSoftDelete: true
    softDeleteRetentionInDays: 90
    enablePurgeProtection: true
    publicNetworkAccess: 'Enabled'
    networkAcls: {
      // Functions Flex Consumption (without VNet integration) and Logic Apps reach the vault as trusted services
      // or from shared outbound addresses; see docs/deploy.md for the private-network variant.
      bypass: 'AzureServices'
      defaultAction: 'Allow'
    }
  }
}

resource teamsSecret 'Microsoft.KeyVault/vaults/secrets@2023-07-01' = {
  // checkov:skip=CKV_AZURE_41:a Teams Workflows URL has no expiry date; an arbitrary one would silently stop all alerts; rotate by redeploying with a new URL
  parent: vault
  name: 'teams-workflow-url'
  properties: {
    value: teamsWorkflowUrl
    contentType: 'text/uri'
    attributes: {
      enabled: true
    }
  }
}

// Secrets User on this one secret: the coordinator resolves its Key Vault reference app setting.
resource coordinatorSecretReader 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(teamsSecret.id, coordinatorPrincipalId, roles.keyVaultSecretsUser.id)
  scope: teamsSecret
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.keyVaultSecretsUser.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

output vaultName string = vault.name
output vaultUri string = vault.properties.vaultUri
output teamsUrlEntryName string = teamsSecret.name
// The secret's URI without version: readers always get the current value. Not the value itself.
output teamsUrlEntryUri string = '${vault.properties.vaultUri}secrets/${teamsSecret.name}'
