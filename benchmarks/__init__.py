"""Benchmarks (``python -m benchmarks``). Every benchmark's clients, and the processes it starts, verify the
emulators' TLS with the local CA through the usual settings (emulators/tls.py)."""

from emulators.tls import trust_local_ca

trust_local_ca()
