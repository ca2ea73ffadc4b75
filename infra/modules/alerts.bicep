// Alerts to Teams that the coordinator cannot send itself. A scheduled query rule over the history table fires an
// action group whose one receiver is a Logic App: it turns the common alert schema into an Adaptive Card and posts
// it to the Teams Workflows URL, which it reads from Key Vault at run time with its own identity (secure
// inputs/outputs keep the URL out of run history). Chosen over a webhook into the Functions app because that would
// need a function key (a secret) or an Entra app registration for a secure webhook; the Logic App receiver needs
// neither. It posts through its own HTTP action, so it still reaches Teams when the coordinator's own posting fails
// for a reason of the coordinator's (its network, a card Teams refuses), not when the Teams URL itself is dead.
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

// The one scheduled query rule. Every event and VM condition (new event, approved, expired unapproved, approval
// failed or refused, not started, conflicting reports, heartbeat lost, two forwarders as one VM) has exactly one
// path: the coordinator's own card. The coordinator decides those conditions, so its card comes first (no 5-minute
// evaluation delay), names the event's facts and the rule, carries the "Approve now" link, and goes out once per
// transition through its outbox; a rule over the same history rows could only repeat it later with less in it, and
// it sees nothing the coordinator did not write (no rows when the coordinator is down). What the coordinator cannot
// card is its own cards failing: that condition, and only it, comes this way (tests/infra/test_alert_paths.py
// fails if a rule here fires on a condition the coordinator cards, or if a rule fires on nothing).
resource cardsFailing 'Microsoft.Insights/scheduledQueryRules@2023-12-01' = {
  name: '${namePrefix}-alert-cards-failing'
  location: location
  tags: tags
  properties: {
    displayName: 'Scheduled events: Teams cards failing'
    description: 'The coordinator could not deliver Teams cards (webhook refused or unreachable after retries); they stay in its outbox and are retried. Look at LastReason.'
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
          query: loadTextContent('../queries/alert-cards-failing.kql')
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

output actionGroupId string = actionGroup.id
output logicAppName string = teamsPoster.name
