#!/usr/bin/env node
// Checks KQL with Microsoft's Kusto language service (@kusto/language-service-next, the parser and binder behind
// Azure Data Explorer's and Log Analytics' editors): syntax and semantics (names, types, function signatures)
// against the history table as coordinator/history_columns.json defines it, and Application Insights' AppMetrics table
// (the columns the workbook's metric panels use, as Azure Monitor's table reference lists them).
//
//   node tools/node/kql-check.js FILE.kql...        one line per problem (FILE:LINE:COLUMN: severity code message),
//                                                    exit 1 if any error or warning
//   node tools/node/kql-check.js --json < in.json    in: {"queries": [{"name", "text"}]}; out: [{"name",
//                                                    "diagnostics": [{"severity", "code", "message", "line",
//                                                    "column"}], "columns": [{"name", "type"}]}] (the result's
//                                                    schema as the binder infers it)
'use strict';

const fs = require('fs');
const path = require('path');

// The package is Bridge.NET output: bridge.js defines the runtime, Kusto.Language.Bridge.js the global `Kusto`.
require('@kusto/language-service-next/bridge.js');
require('@kusto/language-service-next/Kusto.Language.Bridge.js');

const Language = Kusto.Language;
const HISTORY_COLUMNS = path.resolve(__dirname, '..', '..', 'coordinator', 'history_columns.json');
// history_columns.json spells Log Analytics column types as the table API does; KQL calls boolean `bool`.
const KQL_TYPES = { boolean: 'bool' };
// Workspace-based Application Insights' metrics table (learn.microsoft.com, azure-monitor/reference/tables/appmetrics):
// the OpenTelemetry metrics of coordinator/telemetry.py arrive here, one row per metric, export interval and attribute
// set; the attributes are in Properties.
const APP_METRICS = [
  'TimeGenerated: datetime', 'Name: string', 'Sum: real', 'Min: real', 'Max: real', 'ItemCount: int',
  'Properties: dynamic', 'AppRoleName: string', 'AppRoleInstance: string', 'OperationId: string',
].join(', ');
// Suggestions and hidden diagnostics are style hints, not faults.
const FAULTS = new Set(['Error', 'Warning']);

function globals() {
  const history = JSON.parse(fs.readFileSync(HISTORY_COLUMNS, 'utf8'));
  const schema = history.columns.map((c) => `['${c.name}']: ${KQL_TYPES[c.type] || c.type}`).join(', ');
  const table = new Language.Symbols.TableSymbol.$ctor7(history.table, `(${schema})`, null);
  const appMetrics = new Language.Symbols.TableSymbol.$ctor7('AppMetrics', `(${APP_METRICS})`, null);
  const database = new Language.Symbols.DatabaseSymbol.ctor('history', [table, appMetrics]);
  return Language.GlobalState.Default.WithDatabase(database);
}

function analyze(name, text, state) {
  const code = Language.KustoCode.ParseAndAnalyze(text, state);
  const diagnostics = Bridge.toArray(code.GetDiagnostics())
    .filter((d) => FAULTS.has(d.Severity))
    .map((d) => {
      const line = { v: 0 };
      const column = { v: 0 };
      code.TryGetLineAndOffset(d.Start, line, column);
      return { severity: d.Severity.toLowerCase(), code: d.Code, message: d.Message, line: line.v, column: column.v };
    });
  const result = code.ResultType;
  const columns = result && result.Columns
    ? Bridge.toArray(result.Columns).map((c) => ({ name: c.Name, type: c.Type.Name }))
    : [];
  return { name, diagnostics, columns };
}

function main(argv) {
  const state = globals();
  if (argv[0] === '--json') {
    const input = JSON.parse(fs.readFileSync(0, 'utf8'));
    const results = input.queries.map((q) => analyze(q.name, q.text, state));
    process.stdout.write(JSON.stringify(results));
    return 0;
  }
  if (argv.length === 0) {
    process.stderr.write('usage: kql-check.js FILE.kql... | --json < queries.json\n');
    return 2;
  }
  let faults = 0;
  for (const file of argv) {
    const result = analyze(file, fs.readFileSync(file, 'utf8'), state);
    for (const d of result.diagnostics) {
      faults += 1;
      process.stdout.write(`${file}:${d.line}:${d.column}: ${d.severity} ${d.code} ${d.message}\n`);
    }
  }
  process.stdout.write(`${argv.length} queries checked, ${faults} problems\n`);
  return faults ? 1 : 0;
}

process.exitCode = main(process.argv.slice(2));
