// Log Analytics workspace, the coordinator's history table and the data collection rule the coordinator writes
// it through (Logs Ingestion API), and workspace-based Application Insights with Entra-only ingestion.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('The history table definition: coordinator/history_columns.json, loaded by main.bicep (the one definition of its columns).')
param historySchema object

@description('Days the history table stays in interactive retention.')
@minValue(4)
@maxValue(730)
param historyRetentionDays int

@description('Principal id of the coordinator identity (writes history, sends telemetry).')
param coordinatorPrincipalId string

var roles = loadJsonContent('../roles.json')

// history_columns.json uses Log Analytics type names as KQL spells them; the table API and the DCR stream
// declaration spell a few differently.
var tableColumnTypes = {
  string: 'string'
  int: 'int'
  long: 'long'
  real: 'real'
  boolean: 'boolean'
  datetime: 'dateTime'
  guid: 'guid'
  dynamic: 'dynamic'
}
var streamColumnTypes = {
  string: 'string'
  int: 'int'
  long: 'long'
  real: 'real'
  boolean: 'boolean'
  datetime: 'datetime'
  guid: 'string'
  dynamic: 'dynamic'
}
var tableColumns = [for column in historySchema.columns: {
  name: column.name
  type: tableColumnTypes[column.type]
  description: column.description
}]
var streamColumns = [for column in historySchema.columns: {
  name: column.name
  type: streamColumnTypes[column.type]
}]

resource workspace 'Microsoft.OperationalInsights/workspaces@2023-09-01' = {
  name: '${namePrefix}-logs'
  location: location
  tags: tags
  properties: {
    sku: {
      name: 'PerGB2018'
    }
    retentionInDays: 30
    features: {
      disableLocalAuth: true
    }
  }
}

resource historyTable 'Microsoft.OperationalInsights/workspaces/tables@2023-09-01' = {
  parent: workspace
  name: historySchema.table
  properties: {
    plan: 'Analytics'
    retentionInDays: historyRetentionDays
    totalRetentionInDays: historyRetentionDays
    schema: {
      name: historySchema.table
      description: 'Scheduled events history written by the coordinator (coordinator/history_columns.json).'
      columns: tableColumns
    }
  }
}

// kind Direct exposes its own logs ingestion endpoint, so no data collection endpoint is needed.
resource historyDcr 'Microsoft.Insights/dataCollectionRules@2023-03-11' = {
  name: '${namePrefix}-history-dcr'
  location: location
  tags: tags
  kind: 'Direct'
  properties: {
    description: 'Logs Ingestion API route for the coordinator history rows.'
    streamDeclarations: {
      '${historySchema.stream}': {
        columns: streamColumns
      }
    }
    destinations: {
      logAnalytics: [
        {
          name: 'history'
          workspaceResourceId: workspace.id
        }
      ]
    }
    dataFlows: [
      {
        streams: [
          historySchema.stream
        ]
        destinations: [
          'history'
        ]
        transformKql: 'source'
        outputStream: 'Custom-${historyTable.name}'
      }
    ]
  }
}

resource appInsights 'Microsoft.Insights/components@2020-02-02' = {
  name: '${namePrefix}-appi'
  location: location
  tags: tags
  kind: 'web'
  properties: {
    Application_Type: 'web'
    WorkspaceResourceId: workspace.id
    // Entra-only ingestion: the connection string alone cannot write telemetry.
    DisableLocalAuth: true
  }
}

// Monitoring Metrics Publisher on the DCR only: lets the coordinator upload history rows through this one rule.
resource dcrPublisher 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(historyDcr.id, coordinatorPrincipalId, roles.monitoringMetricsPublisher.id)
  scope: historyDcr
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.monitoringMetricsPublisher.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

// Monitoring Metrics Publisher on the component only: Entra-authenticated telemetry from the Functions host.
resource appInsightsPublisher 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(appInsights.id, coordinatorPrincipalId, roles.monitoringMetricsPublisher.id)
  scope: appInsights
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', roles.monitoringMetricsPublisher.id)
    principalId: coordinatorPrincipalId
    principalType: 'ServicePrincipal'
  }
}

output workspaceId string = workspace.id
output workspaceName string = workspace.name
output historyTableName string = historyTable.name
output appInsightsId string = appInsights.id
output appInsightsName string = appInsights.name
output logsIngestionEndpoint string = historyDcr.properties.endpoints.logsIngestion
output historyDcrImmutableId string = historyDcr.properties.immutableId
output historyStreamName string = historySchema.stream
