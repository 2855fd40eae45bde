"""Helpers for the security tests (not a test module): key directories and a real
CURVE-secured AsyncServer on its own thread and event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from moemesh.common.security.curve import CurveKeyPair, generate_key_pair, write_key_pair
from moemesh.common.security.socket_security import SocketSecurity
from moemesh.common.wire import messages as m


def make_keys(keys_dir: Path, *names: str) -> dict[str, CurveKeyPair]:
    """Generate and write one key pair per name into keys_dir."""
    pairs = {name: generate_key_pair(name) for name in names}
    for pair in pairs.values():
        write_key_pair(keys_dir, pair)
    return pairs


def client_security(own: CurveKeyPair, server_endpoint: str, server_public_key: bytes, tmp_dir: Path) -> SocketSecurity:
    """A client-side SocketSecurity that knows one server (its allowed-clients dir is unused)."""
    return SocketSecurity(own_keys=own, server_keys_by_endpoint={server_endpoint: server_public_key},
                          allowed_clients_dir=tmp_dir)


class SecureEchoServer:
    """AsyncServer with `security` (and the ZAP authenticator when `authenticate`) on a thread:
    answers Ping with Pong. `num_handled` counts messages that reached the application."""

    def __init__(self, endpoint: str, security: SocketSecurity | None, *, authenticate: bool = True) -> None:
        self.requested_endpoint = endpoint
        self.security = security
        self.authenticate = authenticate
        self.endpoint = ""
        self.num_handled = 0
        self.authenticator: Any = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def __enter__(self) -> SecureEchoServer:
        self._thread.start()
        assert self._started.wait(10), "server thread did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        assert not self._thread.is_alive(), "server thread did not stop"

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        import zmq.asyncio

        from moemesh.common.wire.transport import AsyncServer

        context = zmq.asyncio.Context()
        server = None
        try:
            if self.authenticate and self.security is not None:
                self.authenticator = self.security.start_authenticator(context)
            server = AsyncServer(self.requested_endpoint, context=context, security=self.security)
            self.endpoint = server.endpoint
            self._task = asyncio.current_task()
            self._started.set()
            while True:
                incoming = await server.recv()
                self.num_handled += 1
                if isinstance(incoming.message, m.Ping) and incoming.expects_reply:
                    await server.reply(incoming, m.Pong(nonce=incoming.message.nonce, name="secure-echo"))
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # reported to the test thread by __enter__
            self.error = error
            self._started.set()
        finally:
            if server is not None:
                server.close()
            if self.authenticator is not None:
                self.authenticator.stop()
            context.term()
