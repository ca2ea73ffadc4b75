// Example parameters: copy, adjust, and deploy with
//   az deployment group create -g <rg> -f infra/main.bicep -p infra/main.bicepparam
// The Teams Workflows URL is a secret: it is read from the environment here, never written into this file.
using './main.bicep'

param namePrefix = 'sefleet'
param orchestrationMode = 'Flexible'
// 0 until forwarder.tar.gz is in the 'forwarder' container (docs/deploy.md step 4), then the fleet size.
param instanceCount = 0
param vmSize = 'Standard_D2s_v5'
param adminUsername = 'fleetadmin'
param sshPublicKey = readEnvironmentVariable('SE_SSH_PUBLIC_KEY')
param terminateNotBeforeTimeout = 'PT10M'
param enableOsImageNotification = false
param enableEventGridPublishing = false
param eventHubPartitionCount = 4
param dryRun = true
param teamsWorkflowUrl = readEnvironmentVariable('SE_TEAMS_WORKFLOW_URL')
