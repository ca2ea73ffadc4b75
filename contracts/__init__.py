"""The contracts the forwarder and the coordinator share, defined once and importing nothing of the project.

- ``envelope``: what a forwarder sends (version 1: incarnation, heartbeat, hook report) and the VM's identity;
- ``document``: the IMDS Scheduled Events document inside an incarnation;
- ``approval``: what the coordinator asks a VM's listener to approve, and its answer;
- ``sas``: a Relay token for a hybrid connection (SAS; the emulator and tests).
- ``attested``: IMDS attested data without a model (nonces, timestamps, the PKCS7's signed content);
- ``wire`` (with ``checks``): the same contracts in the standard library only, for the on-VM forwarder (no pydantic
  there); tests/forwarder/test_wire.py holds them equal to the models.

Shipped with both: the forwarder's package (scripts/package-forwarder.sh) and the Functions app
(scripts/package-functions.sh).
"""
