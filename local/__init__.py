"""Local mode: the whole pipeline on one machine, no Azure account (``python -m local``; docs/local-mode.md).

Emulators (IMDS, Event Hubs, Relay, Azurite) play Azure; one forwarder process per simulated VM sends over AMQP; a
runner hands Event Hubs batches and timer ticks to the same ``function_app`` functions the Functions host calls.
"""
