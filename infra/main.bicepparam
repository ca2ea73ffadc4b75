// Parameters of the deployment. scripts/deploy.sh (or `azd up`, azure.yaml) fills the environment variables and
// deploys; by hand: az deployment group create -g <rg> -f infra/main.bicep -p infra/main.bicepparam
// The Teams Workflows URL is a secret: it is read from the environment here, never written into this file.
using './main.bicep'

param namePrefix = 'sefleet'
param orchestrationMode = 'Flexible'
// 0 until forwarder.tar.gz is uploaded (scripts/deploy.sh keeps the current size until then), then the fleet size.
param instanceCount = int(readEnvironmentVariable('SE_INSTANCE_COUNT', '0'))
param vmSize = 'Standard_D2s_v5'
param adminUsername = 'fleetadmin'
param sshPublicKey = readEnvironmentVariable('SE_SSH_PUBLIC_KEY')
param terminateNotBeforeTimeout = 'PT10M'
param enableOsImageNotification = false
param enableEventGridPublishing = false
param eventHubPartitionCount = 4
param dryRun = true
param teamsWorkflowUrl = readEnvironmentVariable('SE_TEAMS_WORKFLOW_URL')
// The Entra app registration people sign in with (scripts/entra-app.sh ensure prints it).
param signInClientId = readEnvironmentVariable('SE_SIGNIN_CLIENT_ID')
// SHA-256 of build/forwarder.tar.gz (scripts/package-forwarder.sh prints it): VMs install nothing else.
param forwarderPackageSha256 = readEnvironmentVariable('SE_FORWARDER_PACKAGE_SHA256')
