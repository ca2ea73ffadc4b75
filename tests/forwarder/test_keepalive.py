"""The minimal HTTP/1.1 connection against a scripted loopback server: the response shapes IMDS (or a proxy-free
path to it) may produce, split across packets, and connections closed under it; each in plain HTTP (IMDS) and over
TLS (Event Hubs' REST API: the local CA's certificate, verified by ``tls_context()`` through SSL_CERT_FILE)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from emulators.tls import local_tls
from forwarder.keepalive import HttpProtocolError, KeepAliveConnection, build_request, open_socket, tls_context
from tests.loopback import SocketServer

REQUEST = build_request("GET", "127.0.0.1", "/metadata/scheduledevents?api-version=2020-07-01")


class ScriptedServer(SocketServer):
    """Answers each request with the next scripted reply (a list of pieces sent as separate segments; an empty last
    piece closes the connection after it); a reply of None closes the connection without answering. One connection
    at a time."""

    def __init__(self, replies: list[list[bytes] | None], *, tls: bool = False) -> None:
        self.replies = replies
        self.tls = tls
        self.requests: list[bytes] = []
        self.connections = 0
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        self.connections += 1
        if self.tls:
            try:
                connection = local_tls().server_context().wrap_socket(connection, server_side=True)
            except OSError:
                return
        with connection:
            while data := connection.recv(65536):
                self.requests.append(data)
                reply = self.replies.pop(0) if self.replies else None
                if reply is None:
                    break
                try:
                    for piece in reply:
                        connection.sendall(piece)
                        time.sleep(0.01)  # separate TCP segments
                except OSError:
                    break  # the client has gone (it read what it wanted)
                if reply and reply[-1] == b"":  # an empty last piece: close after this reply
                    break


class Servers(list[ScriptedServer]):
    tls = False


@pytest.fixture(params=[False, True], ids=["plain", "tls"])
def serve(request: pytest.FixtureRequest) -> Iterator[Servers]:
    servers = Servers()
    servers.tls = request.param
    yield servers
    for server in servers:
        server.close()


def connect(servers: Servers, replies: list[list[bytes] | None]) -> tuple[ScriptedServer, KeepAliveConnection]:
    server = ScriptedServer(replies, tls=servers.tls)
    servers.append(server)
    tls = tls_context() if servers.tls else None
    return server, KeepAliveConnection("127.0.0.1", server.port, max_body=1000, tls=tls)


OK = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"]


def test_request_bytes() -> None:
    assert REQUEST.startswith(b"GET /metadata/scheduledevents?api-version=2020-07-01 HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert b"Metadata: true\r\n" in REQUEST
    assert REQUEST.endswith(b"\r\n\r\n")
    post = build_request("POST", "h", "/p", body=b'{"a":1}', content_type="application/json")
    assert b"Content-Length: 7\r\n" in post
    assert post.endswith(b'\r\n\r\n{"a":1}')


def test_every_socket_sends_at_once(serve: Servers) -> None:
    """``open_socket``, which opens IMDS's, Event Hubs' and the relay listener's sockets: TCP_NODELAY (a second write
    must not wait for the peer's delayed ACK of the first)."""
    server, conn = connect(serve, [OK])
    assert conn.exchange(REQUEST, timeout=2).status == 200
    assert conn._sock is not None
    assert conn._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    conn.close()  # the scripted server takes one connection at a time
    direct = open_socket("127.0.0.1", server.port, timeout=2, tls=tls_context() if serve.tls else None)
    with direct:
        assert direct.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_content_length_split_across_segments_and_kept_alive(serve: Servers) -> None:
    split = [b"HTTP/1.1 200 OK\r\nConte", b'nt-Length: 12\r\n\r\n{"a":', b" 12345}"]
    server, conn = connect(serve, [split, OK])
    assert conn.exchange(REQUEST, timeout=2).body == b'{"a": 12345}'
    assert conn.exchange(REQUEST, timeout=2).body == b"{}"
    assert server.connections == 1
    assert server.requests == [REQUEST, REQUEST]


def test_bytes_beyond_the_content_length_are_not_read_as_the_next_answer(serve: Servers) -> None:
    surplus = [b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"a": 12345}']
    server, conn = connect(serve, [surplus, OK])
    response = conn.exchange(REQUEST, timeout=2)
    assert (response.body, response.close) == (b'{"a": 12345', True)  # out of step: the connection is dropped
    assert conn.exchange(REQUEST, timeout=2).body == b"{}"
    assert server.connections == 2


def test_chunked_body_with_trailer(serve: Servers) -> None:
    chunked = [
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\n{"a"\r\n',
        b"3\r\n:1}\r\n0\r\nX-T: 1\r\n\r\n",
    ]
    server, conn = connect(serve, [chunked, OK])
    assert conn.exchange(REQUEST, timeout=2).body == b'{"a":1}'
    assert conn.exchange(REQUEST, timeout=2).body == b"{}"  # the trailer was consumed: still in step
    assert server.connections == 1


def test_body_until_close_and_connection_close(serve: Servers) -> None:
    _, conn = connect(serve, [[b'HTTP/1.0 200 OK\r\n\r\n{"x": 1}', b""]])
    response = conn.exchange(REQUEST, timeout=2)
    assert response.body == b'{"x": 1}'
    assert response.close


def test_status_and_retry_after(serve: Servers) -> None:
    _, conn = connect(serve, [[b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: 0\r\n\r\n"]])
    response = conn.exchange(REQUEST, timeout=2)
    assert (response.status, response.retry_after, response.body) == (429, "3", b"")


def test_idle_connection_closed_by_the_server_is_retried_once(serve: Servers) -> None:
    server, conn = connect(serve, [OK, None, OK])
    conn.exchange(REQUEST, timeout=2)
    # The server drops the kept-alive connection without answering the next request: a fresh one is used.
    assert conn.exchange(REQUEST, timeout=2).body == b"{}"
    assert server.connections == 2


def test_a_fresh_connection_closed_without_answer_is_an_error(serve: Servers) -> None:
    _, conn = connect(serve, [None])
    with pytest.raises(ConnectionError, match="closed the connection before answering"):
        conn.exchange(REQUEST, timeout=2)


def test_not_http_is_a_protocol_error(serve: Servers) -> None:
    _, conn = connect(serve, [[b"SSH-2.0-OpenSSH\r\n\r\n"]])
    with pytest.raises(HttpProtocolError, match=r"not an HTTP/1\.x status line"):
        conn.exchange(REQUEST, timeout=2)


def test_oversized_headers_are_a_protocol_error(serve: Servers) -> None:
    endless_head = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 100_000
    _, conn = connect(serve, [[endless_head, b""]])
    with pytest.raises(HttpProtocolError, match="response headers are too large"):
        conn.exchange(REQUEST, timeout=2)


def test_truncated_body_is_a_protocol_error(serve: Servers) -> None:
    _, conn = connect(serve, [[b'HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{"short"', b""]])
    with pytest.raises(HttpProtocolError, match="in the middle of a response"):
        conn.exchange(REQUEST, timeout=2)


def test_oversized_body_is_cut_and_the_connection_dropped(serve: Servers) -> None:
    big = [b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000]
    _, conn = connect(serve, [big])
    response = conn.exchange(REQUEST, timeout=2)
    assert len(response.body) == 1001  # max_body + 1: the caller can tell it was too large
    assert response.close


def test_silence_times_out(serve: Servers) -> None:
    _, conn = connect(serve, [[b"HTTP/1.1 200 OK\r\n"]])  # never finishes the head
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.exchange(REQUEST, timeout=0.3)
    assert time.monotonic() - started < 2
