"""The contracts the forwarder and the coordinator share, defined once and importing nothing of the project.

- ``envelope``: what a forwarder sends (version 1: incarnation, heartbeat, hook report) and the VM's identity;
- ``document``: the IMDS Scheduled Events document inside an incarnation;
- ``approval``: what the coordinator asks a VM's listener to approve, and its answer;
- ``sas``: a Relay token for a hybrid connection (SAS; the emulator and tests).
- ``attested``: IMDS attested data without a model (nonces, timestamps, the PKCS7's signed content);
- ``wire``: the same contracts for the on-VM forwarder (no pydantic there), generated from the models by
  ``python -m contracts.generate`` (``wire_validators``, ``wire_records``; read by ``schema_record``), with what no
  JSON schema states in ``wire_rules``; ``checks``: the records of the forwarder's settings and Relay messages.

Shipped with both: the forwarder's package (scripts/package-forwarder.sh) and the Functions app
(scripts/package-functions.sh).
"""
