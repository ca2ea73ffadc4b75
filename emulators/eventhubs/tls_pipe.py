"""AMQP over TLS, as the service serves it on 5671: one server-side TLS session over memory buffers per connection.

proton's transport can speak TLS itself, but then its output is ciphertext before :class:`FramePadder` (framing.py:
why the emulator rewrites proton's frames) could see a frame. So the broker keeps TLS on its side of the padder:
ciphertext read from the socket goes in here and comes out as the plaintext proton reads; proton's padded output
goes in here and comes out as the ciphertext written to the socket. Pure: no socket, no thread.
"""

from __future__ import annotations

import ssl

__all__ = ["TlsPipe"]

_READ_SIZE = 65536


class TlsPipe:
    """The server side of one TLS session: :meth:`receive` ciphertext, :meth:`send` plaintext, and write what
    :meth:`outgoing` returns. A peer that breaks the handshake or a record raises ``ssl.SSLError`` from
    :meth:`receive` (a client that does not trust the certificate ends the handshake with an alert)."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._session = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._ready = False
        # What proton wrote before the handshake finished (TLS carries no application data until then).
        self._waiting = bytearray()
        self.closed = False  # the client ended the session (close_notify): nothing more will come

    @property
    def ready(self) -> bool:
        """Whether the handshake is done."""
        return self._ready

    def receive(self, data: bytes) -> bytes:
        """Ciphertext from the socket in; the plaintext it completes out (``b""`` while the handshake runs or a
        record is still partial)."""
        self._incoming.write(data)
        if not self._ready:
            try:
                self._session.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self._ready = True
            if self._waiting:
                self._session.write(bytes(self._waiting))
                self._waiting.clear()
        plain = bytearray()
        while True:
            try:
                chunk = self._session.read(_READ_SIZE)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self.closed = True
                break
            if not chunk:  # the SSLObject's way of saying close_notify came
                self.closed = True
                break
            plain += chunk
        return bytes(plain)

    def send(self, plain: bytes) -> None:
        """Plaintext to send; held until the handshake is done."""
        if not plain:
            return
        if self._ready:
            self._session.write(plain)
        else:
            self._waiting += plain

    def outgoing(self) -> bytes:
        """The ciphertext to write to the socket now (handshake records included)."""
        return self._outgoing.read()
