"""The on-VM forwarder: IMDS Scheduled Events -> Event Hubs, and approvals back from Azure Relay."""

__version__ = "0.1.0"
