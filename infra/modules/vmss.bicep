// The Linux scale set whose instances run the forwarder. Scheduled events are configured so that the project's
// approval rules, not the platform, decide when an impactful event may start.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Uniform or Flexible orchestration.')
@allowed([
  'Uniform'
  'Flexible'
])
param orchestrationMode string

@description('Number of instances.')
@minValue(0)
@maxValue(1000)
param instanceCount int

@description('VM size of the instances.')
param vmSize string

@description('Local administrator name (SSH key only; password authentication is disabled).')
param adminUsername string

@description('OpenSSH public key of the administrator.')
param sshPublicKey string

@description('Notice a Terminate (delete/scale-in) event gives before the instance goes: ISO 8601, 5 to 15 minutes.')
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
param terminateNotBeforeTimeout string

@description('Announce OS image upgrades/reimages as scheduled events (OSUpgrade) with the fixed 15-minute notice.')
param enableOsImageNotification bool

@description('Preview: also publish scheduled events to Event Grid and Azure Resource Graph (needs feature registration, see docs/deploy.md).')
param enableEventGridPublishing bool

@description('Preview: the coordinator may acknowledge this scale set\'s scheduled events through the Maintenance RP.')
param enableRemoteAcknowledge bool

@description('The coordinator may suspend the automatic repairs of this resource group\'s scale sets while an approved Reboot, Redeploy or Freeze is in flight, and resume them after (the Scheduled Events Repairs Operator role on the resource group).')
param enableRepairsSuspension bool

@description('Principal id of the coordinator identity (reads the census; acknowledges scheduled events when enableRemoteAcknowledge; suspends and resumes automatic repairs when enableRepairsSuspension).')
param coordinatorPrincipalId string

@description('Subnet of the instances.')
param subnetId string

@description('Resource id of the forwarders\' user-assigned identity.')
param vmIdentityId string

@description('Client id of that identity (the forwarder asks IMDS for its tokens).')
param vmIdentityClientId string

@description('Event Hubs fully qualified namespace.')
param eventHubNamespace string

@description('Event hub that carries the envelopes.')
param eventHubName string

@description('Azure Relay fully qualified namespace.')
param relayNamespace string

@description('URL of the forwarder package (tar.gz holding forwarder/install.sh).')
param forwarderPackageUrl string

@description('SHA-256 (hex) of that package: an instance installs it only if the download has this digest.')
@minLength(64)
@maxLength(64)
param forwarderPackageSha256 string

@description('Seconds between forwarder heartbeats.')
@minValue(10)
@maxValue(3600)
param heartbeatSeconds int

var isFlexible = orchestrationMode == 'Flexible'
// Fill the cloud-init template's __NAME__ placeholders (replace, not format: its shell script uses braces).
var cloudInitTemplate = loadTextContent('../cloud-init/forwarder.yaml')
var cloudInitHub = replace(replace(cloudInitTemplate, '__EVENTHUB_NAMESPACE__', eventHubNamespace), '__EVENTHUB_NAME__', eventHubName)
var cloudInitIdentity = replace(replace(cloudInitHub, '__CLIENT_ID__', vmIdentityClientId), '__RELAY_NAMESPACE__', relayNamespace)
var cloudInitPackage = replace(replace(cloudInitIdentity, '__HEARTBEAT_SECONDS__', string(heartbeatSeconds)), '__PACKAGE_URL__', forwarderPackageUrl)
var cloudInit = replace(cloudInitPackage, '__PACKAGE_SHA256__', toLower(forwarderPackageSha256))

// Scheduled events also go to Event Grid (system topic Microsoft.ResourceNotifications.MaintenanceResources) and
// Azure Resource Graph, in the IMDS 2020-07-01 shape.
var eventGridPublishing = {
  eventGridAndResourceGraph: {
    enable: true
    scheduledEventsApiVersion: '2020-07-01'
  }
}

resource vmss 'Microsoft.Compute/virtualMachineScaleSets@2025-04-01' = {
  // checkov:skip=CKV_AZURE_95:automatic OS image upgrades would reimage instances on the platform's schedule; image rollout is an operator decision announced through osImageNotificationProfile
  name: '${namePrefix}-vmss'
  location: location
  tags: tags
  sku: {
    name: vmSize
    tier: 'Standard'
    capacity: instanceCount
  }
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${vmIdentityId}': {}
    }
  }
  properties: {
    orchestrationMode: orchestrationMode
    platformFaultDomainCount: 1
    singlePlacementGroup: false
    // Uniform only: overprovisioned extra instances would start forwarders (and hybrid connections) that are
    // deleted again at once. Flexible does not take the property.
    overprovision: isFlexible ? null : false
    upgradePolicy: {
      mode: 'Manual'
    }
    // Set explicitly (allInstancesDown defaults to true): an automatically approved event skips Scheduled, so the
    // coordinator's rules would never see it.
    scheduledEventsPolicy: {
      userInitiatedRedeploy: {
        automaticallyApprove: false
      }
      userInitiatedReboot: {
        automaticallyApprove: false
      }
      allInstancesDown: {
        automaticallyApprove: false
      }
      // Preview, behind a feature flag: left out entirely (null) unless asked for.
      scheduledEventsAdditionalPublishingTargets: enableEventGridPublishing ? eventGridPublishing : null
    }
    virtualMachineProfile: {
      scheduledEventsProfile: {
        terminateNotificationProfile: {
          enable: true
          notBeforeTimeout: terminateNotBeforeTimeout
        }
        osImageNotificationProfile: {
          enable: enableOsImageNotification
          // The only value the platform accepts.
          notBeforeTimeout: 'PT15M'
        }
      }
      osProfile: {
        computerNamePrefix: take(replace(namePrefix, '-', ''), 9)
        adminUsername: adminUsername
        customData: base64(cloudInit)
        linuxConfiguration: {
          disablePasswordAuthentication: true
          provisionVMAgent: true
          ssh: {
            publicKeys: [
              {
                path: '/home/${adminUsername}/.ssh/authorized_keys'
                keyData: sshPublicKey
              }
            ]
          }
        }
      }
      storageProfile: {
        imageReference: {
          publisher: 'Canonical'
          offer: 'ubuntu-24_04-lts'
          sku: 'server'
          version: 'latest'
        }
        osDisk: {
          createOption: 'FromImage'
          caching: 'ReadWrite'
          managedDisk: {
            storageAccountType: 'Premium_LRS'
          }
        }
      }
      securityProfile: {
        securityType: 'TrustedLaunch'
        uefiSettings: {
          secureBootEnabled: true
          vTpmEnabled: true
        }
        // Temp disk and caches encrypted at the host; needs the subscription feature Microsoft.Compute/EncryptionAtHost.
        encryptionAtHost: true
      }
      networkProfile: {
        // Flexible orchestration creates the NICs itself and needs the network API version; Uniform rejects it.
        networkApiVersion: isFlexible ? '2020-11-01' : null
        networkInterfaceConfigurations: [
          {
            name: 'nic'
            properties: {
              primary: true
              enableAcceleratedNetworking: false
              ipConfigurations: [
                {
                  name: 'ipconfig'
                  properties: {
                    primary: true
                    subnet: {
                      id: subnetId
                    }
                  }
                }
              ]
            }
          }
        ]
      }
      diagnosticsProfile: {
        bootDiagnostics: {
          enabled: true
        }
      }
    }
  }
}

// Custom role for remote acknowledge (preview): the docs name the role "ScheduledEventContributor" (read and
// acknowledge scheduled events) but publish no id for it, so it cannot be checked against the built-in list. This
// one holds the acknowledge action alone, assignable in this resource group only. The action name follows ARM's
// {provider}/{type}/{action}/action convention for POST .../scheduledevents/{id}/acknowledge; it is NOT confirmed by
// a published operations list (docs/deploy.md): a 403 AuthorizationFailed on acknowledge means it is not the one.
resource scheduledEventAcknowledger 'Microsoft.Authorization/roleDefinitions@2022-04-01' = if (enableRemoteAcknowledge) {
  name: guid(resourceGroup().id, 'scheduled-events-acknowledger')
  properties: {
    roleName: 'Scheduled Events Acknowledger (${resourceGroup().name})'
    description: 'Acknowledge (approve) scheduled events of virtual machines and scale sets; nothing else.'
    type: 'CustomRole'
    assignableScopes: [
      resourceGroup().id
    ]
    permissions: [
      {
        actions: [
          'Microsoft.Maintenance/scheduledevents/acknowledge/action'
        ]
        notActions: []
        dataActions: []
        notDataActions: []
      }
    ]
  }
}

// The acknowledge role on this scale set only: the coordinator approves its events without a VM (remote
// acknowledge, preview), and no other resource's.
resource coordinatorAcknowledger 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (enableRemoteAcknowledge) {
  name: guid(vmss.id, coordinatorPrincipalId, 'scheduled-events-acknowledger')
  scope: vmss
  properties: {
    roleDefinitionId: scheduledEventAcknowledger.id
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// The census (coordinator/adapters/census.py): the coordinator lists the scale sets, a Uniform scale set's instances and
// the resource group's VMs (a Flexible scale set's members are VMs of the resource group) with their instance views,
// to read zones, fault and update domains, placement groups and tags from Azure rather than from the VMs. A custom
// role with those reads alone, not Reader: Reader on the resource group would also read every other resource's
// configuration here (Key Vault, storage, the Functions app, the Relay namespace). The instanceView reads are listed
// in case the Compute RP checks them for $expand=instanceView (not verified in Azure).
resource vmCensusReader 'Microsoft.Authorization/roleDefinitions@2022-04-01' = {
  name: guid(resourceGroup().id, 'scheduled-events-vm-census-reader')
  properties: {
    roleName: 'Scheduled Events VM Census Reader (${resourceGroup().name})'
    description: 'Read virtual machines and scale sets (and their instance views); nothing else.'
    type: 'CustomRole'
    assignableScopes: [
      resourceGroup().id
    ]
    permissions: [
      {
        actions: [
          'Microsoft.Compute/virtualMachineScaleSets/read'
          'Microsoft.Compute/virtualMachineScaleSets/virtualMachines/read'
          'Microsoft.Compute/virtualMachineScaleSets/virtualMachines/instanceView/read'
          'Microsoft.Compute/virtualMachines/read'
          'Microsoft.Compute/virtualMachines/instanceView/read'
        ]
        notActions: []
        dataActions: []
        notDataActions: []
      }
    ]
  }
}

// The census reads on this resource group (its scope: a list of the group's VMs is authorized there, and a
// Flexible scale set's members are not children of the scale set): the coordinator reads the fleet's facts from ARM.
resource coordinatorCensusReader 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(resourceGroup().id, coordinatorPrincipalId, 'scheduled-events-vm-census-reader')
  properties: {
    roleDefinitionId: vmCensusReader.id
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Automatic repairs held while maintenance runs: a scale set with automatic repairs counts an instance that a
// maintenance reboot took down as unhealthy and replaces it, so the coordinator suspends the AutomaticRepairs
// service (setOrchestrationServiceState) while an approved Reboot, Redeploy or Freeze is in flight on its VMs and
// resumes it after. A custom role with that one action and the scale set read it checks the policy with, not
// Virtual Machine Contributor, which would also let the coordinator restart, reimage, redeploy and delete every VM
// and scale set here, and change their configuration.
resource repairsOperator 'Microsoft.Authorization/roleDefinitions@2022-04-01' = if (enableRepairsSuspension) {
  name: guid(resourceGroup().id, 'scheduled-events-repairs-operator')
  properties: {
    roleName: 'Scheduled Events Repairs Operator (${resourceGroup().name})'
    description: 'Read virtual machine scale sets and suspend or resume their automatic repairs; nothing else.'
    type: 'CustomRole'
    assignableScopes: [
      resourceGroup().id
    ]
    permissions: [
      {
        actions: [
          'Microsoft.Compute/virtualMachineScaleSets/read'
          'Microsoft.Compute/virtualMachineScaleSets/setOrchestrationServiceState/action'
        ]
        notActions: []
        dataActions: []
        notDataActions: []
      }
    ]
  }
}

// The repairs role on this resource group, where the census role is: the coordinator holds the repairs of the
// scale sets its census reads (the group's, COORDINATOR_CENSUS_RESOURCE_GROUPS), not only the one deployed here.
resource coordinatorRepairsOperator 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (enableRepairsSuspension) {
  name: guid(resourceGroup().id, coordinatorPrincipalId, 'scheduled-events-repairs-operator')
  properties: {
    roleDefinitionId: repairsOperator.id
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

output vmssName string = vmss.name
output vmssId string = vmss.id
