"""Operator tools, run with ``python -m`` from a checkout and never shipped to Azure: ``ops.policy`` (check, test,
simulate a policy), ``ops.history`` (query the local history, SQL or KQL), ``ops.cost`` (the callback's cost)."""
