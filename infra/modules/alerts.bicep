// Alerts to Teams. Scheduled query rules over the history table fire an action group whose one receiver is a
// Logic App: it turns the common alert schema into an Adaptive Card and posts it to the Teams Workflows URL,
// which it reads from Key Vault at run time with its own identity (secure inputs/outputs keep the URL out of run
// history). Chosen over a webhook into the Functions app because that would need a function key (a secret) or
// an Entra app registration for a secure webhook; the Logic App receiver needs neither.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Resource id of the Log Analytics workspace holding the history table.')
param workspaceId string

@description('Name of the Key Vault holding the Teams Workflows URL.')
param keyVaultName string

@description('Name of that secret.')
param teamsUrlEntryName string

var roles = loadJsonContent('../roles.json')
var keyVaultAudience = 'https://${substring(environment().suffixes.keyvaultDns, 1)}'

resource vault 'Microsoft.KeyVault/vaults@2023-07-01' existing = {
  name: keyVaultName
}

resource teamsSecret 'Microsoft.KeyVault/vaults/secrets@2023-07-01' existing = {
  parent: vault
  name: teamsUrlEntryName
}

resource teamsPoster 'Microsoft.Logic/workflows@2019-05-01' = {
  name: '${namePrefix}-alerts-to-teams'
  location: location
  tags: tags
  identity: {
    type: 'SystemAssigned'
  }
  properties: {
    state: 'Enabled'
    definition: {
      '$schema': 'https://schema.management.azure.com/providers/Microsoft.Logic/schemas/2016-06-01/workflowdefinition.json#'
      contentVersion: '1.0.0.0'
      triggers: {
        manual: {
          type: 'Request'
          kind: 'Http'
          inputs: {
            schema: {
              type: 'object'
            }
          }
        }
      }
      actions: {
        Read_Teams_URL: {
          type: 'Http'
          inputs: {
            method: 'GET'
            uri: '${vault.properties.vaultUri}secrets/${teamsSecret.name}?api-version=7.4'
            authentication: {
              type: 'ManagedServiceIdentity'
              audience: keyVaultAudience
            }
          }
          runtimeConfiguration: {
            secureData: {
              properties: [
                'inputs'
                'outputs'
              ]
            }
          }
        }
        Post_card: {
          type: 'Http'
          runAfter: {
            Read_Teams_URL: [
              'Succeeded'
            ]
          }
          inputs: {
            method: 'POST'
            uri: '''@{body('Read_Teams_URL')?['value']}'''
            headers: {
              'Content-Type': 'application/json'
            }
            body: {
              type: 'message'
              attachments: [
                {
                  contentType: 'application/vnd.microsoft.card.adaptive'
                  contentUrl: null
                  content: {
                    '$schema': 'http://adaptivecards.io/schemas/adaptive-card.json'
                    type: 'AdaptiveCard'
                    version: '1.4'
                    body: [
                      {
                        type: 'TextBlock'
                        size: 'Medium'
                        weight: 'Bolder'
                        wrap: true
                        text: '''@{triggerBody()?['data']?['essentials']?['monitorCondition']}: @{triggerBody()?['data']?['essentials']?['alertRule']}'''
                      }
                      {
                        type: 'TextBlock'
                        wrap: true
                        text: '''@{triggerBody()?['data']?['essentials']?['description']}'''
                      }
                      {
                        type: 'FactSet'
                        facts: [
                          {
                            title: 'Severity'
                            value: '''@{triggerBody()?['data']?['essentials']?['severity']}'''
                          }
                          {
                            title: 'Fired'
                            value: '''@{triggerBody()?['data']?['essentials']?['firedDateTime']}'''
                          }
                        ]
                      }
                    ]
                    actions: [
                      {
                        type: 'Action.OpenUrl'
                        title: 'Open the results'
                        url: '''@{first(triggerBody()?['data']?['alertContext']?['condition']?['allOf'])?['linkToFilteredSearchResultsUI']}'''
                      }
                    ]
                  }
                }
              ]
            }
          }
          runtimeConfiguration: {
            secureData: {
              properties: [
                'inputs'
              ]
            }
          }
        }
      }
      outputs: {}
    }
  }
}

// Secrets User on the one secret: the Logic App reads the Teams URL and nothing else in the vault.
resource posterSecretReader 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(teamsSecret.id, teamsPoster.id, roles.keyVaultSecretsUser.id)
  scope: teamsSecret
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.keyVaultSecretsUser.id)
    principalId: teamsPoster.identity.principalId
    principalType: 'ServicePrincipal'
  }
}

resource actionGroup 'Microsoft.Insights/actionGroups@2023-01-01' = {
  name: '${namePrefix}-teams-ag'
  location: 'global'
  tags: tags
  properties: {
    groupShortName: 'se-teams'
    enabled: true
    logicAppReceivers: [
      {
        name: 'teams'
        resourceId: teamsPoster.id
        // ARM needs the trigger's callback URL here; it stays inside the action group (never an output).
        callbackUrl: listCallbackUrl('${teamsPoster.id}/triggers/manual', '2019-05-01').value
        useCommonAlertSchema: true
      }
    ]
  }
}

resource expiredUnapproved 'Microsoft.Insights/scheduledQueryRules@2023-12-01' = {
  name: '${namePrefix}-event-expired-unapproved'
  location: location
  tags: tags
  properties: {
    displayName: 'Scheduled event expired unapproved'
    description: 'An event reached its NotBefore without an approval: the platform went ahead on its own schedule.'
    severity: 2
    enabled: true
    scopes: [
      workspaceId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT5M'
    criteria: {
      allOf: [
        {
          query: loadTextContent('../queries/alert-expired-unapproved.kql')
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: false
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}

resource approvalFailed 'Microsoft.Insights/scheduledQueryRules@2023-12-01' = {
  name: '${namePrefix}-approval-failed'
  location: location
  tags: tags
  properties: {
    displayName: 'Scheduled event approval failing'
    description: 'The coordinator could not deliver or execute an approval (Relay, listener or IMDS error).'
    severity: 1
    enabled: true
    scopes: [
      workspaceId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'PT5M'
    criteria: {
      allOf: [
        {
          query: loadTextContent('../queries/alert-approval-failed.kql')
          timeAggregation: 'Count'
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: false
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}

// Stateful (autoMitigate): one alert per silent VM, resolved when the coordinator records it resumed. The window
// covers the query's own one-day lookback. If the coordinator itself is down, no
// rows are written at all: watch the Functions app's own availability for that.
resource heartbeatStopped 'Microsoft.Insights/scheduledQueryRules@2023-12-01' = {
  name: '${namePrefix}-forwarder-heartbeat-stopped'
  location: location
  tags: tags
  properties: {
    displayName: 'Forwarder heartbeat stopped'
    description: 'The coordinator lost a VM\'s heartbeat: its scheduled events are not being seen.'
    severity: 2
    enabled: true
    scopes: [
      workspaceId
    ]
    evaluationFrequency: 'PT5M'
    windowSize: 'P1D'
    criteria: {
      allOf: [
        {
          query: loadTextContent('../queries/silent-forwarders.kql')
          timeAggregation: 'Count'
          dimensions: [
            {
              name: 'VmName'
              operator: 'Include'
              values: [
                '*'
              ]
            }
          ]
          operator: 'GreaterThan'
          threshold: 0
          failingPeriods: {
            numberOfEvaluationPeriods: 1
            minFailingPeriodsToAlert: 1
          }
        }
      ]
    }
    autoMitigate: true
    actions: {
      actionGroups: [
        actionGroup.id
      ]
    }
  }
}

output actionGroupId string = actionGroup.id
output logicAppName string = teamsPoster.name
