// User-assigned identities, created first so that every role assignment exists before the VMs and the
// Functions app start (a system-assigned identity only exists once its resource does, which races the RBAC).
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

// One identity for all forwarders: the scale set's instances are interchangeable.
resource vmIdentity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: '${namePrefix}-forwarder-id'
  location: location
  tags: tags
}

// The coordinator's identity: the Functions app, its host storage and the deployment package use it.
resource coordinatorIdentity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: '${namePrefix}-coordinator-id'
  location: location
  tags: tags
}

// Only for the sign-in of people (App Service Authentication): the Entra app registration trusts this identity
// through a federated credential instead of a client secret. It holds no role anywhere and is attached only to the
// Functions app, so nothing else can sign in as the app registration.
resource signInIdentity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: '${namePrefix}-signin-id'
  location: location
  tags: tags
}

output vmIdentityId string = vmIdentity.id
output vmIdentityPrincipalId string = vmIdentity.properties.principalId
output vmIdentityClientId string = vmIdentity.properties.clientId
output coordinatorIdentityId string = coordinatorIdentity.id
output coordinatorIdentityPrincipalId string = coordinatorIdentity.properties.principalId
output coordinatorIdentityClientId string = coordinatorIdentity.properties.clientId
output signInIdentityId string = signInIdentity.id
output signInIdentityPrincipalId string = signInIdentity.properties.principalId
output signInIdentityClientId string = signInIdentity.properties.clientId
