"""Drills: real user-initiated events through ARM on chosen VMs of a scale set, to rehearse hooks and policies
before the platform's own events come (``python -m ops.drill``; docs/drills.md)."""
