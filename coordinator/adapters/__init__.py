"""What the coordinator talks to besides its state: the approval callbacks (Relay, the Maintenance RP's acknowledge),
Relay administration, health gates (HTTP, Azure Monitor), history sinks, Teams card sinks and telemetry."""
