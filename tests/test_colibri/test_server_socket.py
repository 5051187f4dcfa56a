"""The server's listening socket: the connections it accepts send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from colibri.server.app import _listen


def test_accepted_connections_have_nagle_off() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose protocol is IPPROTO_TCP; a listener made
    with protocol 0 passed that 0 on to every connection, and each response body then waited
    for the client's delayed ACK of its headers (40 ms per request on a kept-alive
    connection)."""
    sock = _listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
            done.set()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.wait_for(done.wait(), 10)
            w.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
