// The Azure Monitor workbook over the history table; its JSON is generated from infra/queries/*.kql by
// infra/build_workbook.py.
@description('Azure region.')
param location string

@description('Prefix of every resource name.')
param namePrefix string

@description('Tags applied to every resource.')
param tags object

@description('Resource id of the Log Analytics workspace the workbook queries.')
param workspaceId string

resource workbook 'Microsoft.Insights/workbooks@2023-06-01' = {
  name: guid(resourceGroup().id, namePrefix, 'scheduled-events-workbook')
  location: location
  tags: tags
  kind: 'shared'
  properties: {
    displayName: 'Scheduled events fleet (${namePrefix})'
    category: 'workbook'
    sourceId: workspaceId
    serializedData: replace(loadTextContent('../workbook.json'), '__WORKSPACE_RESOURCE_ID__', workspaceId)
  }
}

output workbookId string = workbook.id
