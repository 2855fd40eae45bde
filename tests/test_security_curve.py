"""CURVE over real sockets: the right keys get replies; unknown client keys, a wrong server
key and plain clients get nothing within an explicit bound, and the server keeps serving."""

from __future__ import annotations

import stat
import time

import pytest
import zmq
import zmq.auth
from security_support import SecureEchoServer, client_security, make_keys

from moemesh.common.security.curve import (
    KeyFileError, check_key_name, generate_key_pair, load_key_pair, load_public_key, load_public_keys, write_key_pair,
)
from moemesh.common.security.socket_security import SocketSecurity
from moemesh.common.wire import messages as m
from moemesh.common.wire.errors import ReplyTimeout
from moemesh.common.wire.transport import SyncClient

REFUSED_WAIT_S = 0.6  # how long a refused client waits for a reply that must never come


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------ key files


def test_key_files_have_right_modes_and_load_back(tmp_path):
    keys_dir = tmp_path / "keys"
    pair = generate_key_pair("expert-0")
    paths = write_key_pair(keys_dir, pair)
    assert _mode(keys_dir) == 0o700
    assert _mode(paths.secret_path) == 0o600
    assert _mode(paths.public_path) == 0o644
    assert "secret-key" not in paths.public_path.read_text()
    loaded = load_key_pair(keys_dir, "expert-0")
    assert loaded == pair
    assert load_public_key(paths.public_path) == pair.public_key
    assert load_public_keys(keys_dir) == {"expert-0": pair.public_key}
    # ZeroMQ's own certificate reader understands the files
    assert zmq.auth.load_certificate(str(paths.secret_path)) == (pair.public_key, pair.secret_key)
    assert zmq.auth.load_certificate(str(paths.public_path)) == (pair.public_key, None)
    assert pair.secret_key.decode() not in repr(pair)


def test_existing_keys_are_kept_unless_overwrite(tmp_path):
    first = generate_key_pair("router")
    write_key_pair(tmp_path, first)
    with pytest.raises(FileExistsError):
        write_key_pair(tmp_path, generate_key_pair("router"))
    assert load_key_pair(tmp_path, "router") == first
    second = generate_key_pair("router")
    write_key_pair(tmp_path, second, overwrite=True)
    assert load_key_pair(tmp_path, "router") == second
    assert _mode(tmp_path / "router.key_secret") == 0o600


def test_widely_readable_or_malformed_secret_is_refused(tmp_path):
    paths = write_key_pair(tmp_path, generate_key_pair("draft"))
    paths.secret_path.chmod(0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_key_pair(tmp_path, "draft")
    paths.secret_path.chmod(0o600)
    text = paths.secret_path.read_text()
    paths.secret_path.write_text(text.replace("secret-key", "secret-kex"))
    with pytest.raises(KeyFileError, match="no secret-key"):
        load_key_pair(tmp_path, "draft")
    paths.public_path.write_text('curve\n    public-key = "tooshort"\n')
    with pytest.raises(KeyFileError, match="40 Z85"):
        load_public_key(paths.public_path)
    with pytest.raises(KeyFileError, match="no such key file"):
        load_key_pair(tmp_path, "absent")


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "", "x" * 200, "sp ace"])
def test_key_names_cannot_escape_the_directory(name):
    with pytest.raises(ValueError):
        check_key_name(name)


# ------------------------------------------------------------------ sockets


@pytest.fixture()
def keyed(tmp_path):
    """allowed/ holds the server's and the good client's public keys; `rogue` is not in it."""
    allowed = tmp_path / "allowed"
    pairs = make_keys(allowed, "server", "client")
    pairs["rogue"] = generate_key_pair("rogue")
    server_security = SocketSecurity(own_keys=load_key_pair(allowed, "server"), allowed_clients_dir=allowed)
    return tmp_path, pairs, server_security


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request, tmp_path):
    return "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{tmp_path}/secure.sock"


def _ping(context, security, endpoint, nonce, timeout_s):
    client = SyncClient(endpoint, context=context, default_timeout_s=timeout_s, security=security)
    try:
        return client.request(m.Ping(nonce=nonce))
    finally:
        client.close()


def test_curve_round_trip_and_refusals(keyed, endpoint):
    tmp_path, pairs, server_security = keyed
    context = zmq.Context()
    try:
        with SecureEchoServer(endpoint, server_security) as server:
            public = pairs["server"].public_key
            good = client_security(pairs["client"], server.endpoint, public, tmp_path)
            assert _ping(context, good, server.endpoint, 1, 5.0).nonce == 1

            refused = {
                "unknown client key": client_security(pairs["rogue"], server.endpoint, public, tmp_path),
                "wrong server key": client_security(pairs["client"], server.endpoint, pairs["rogue"].public_key, tmp_path),
                "no CURVE at all": None,
            }
            for label, security in refused.items():
                started = time.monotonic()
                with pytest.raises(ReplyTimeout):
                    _ping(context, security, server.endpoint, 2, REFUSED_WAIT_S)
                assert time.monotonic() - started < REFUSED_WAIT_S + 2.0, label  # the bound holds
            assert server.num_handled == 1  # nothing of theirs reached the application

            assert _ping(context, good, server.endpoint, 3, 5.0).nonce == 3  # still serving
            assert server.num_handled == 2
    finally:
        context.term()


def test_server_without_authenticator_fails_closed(keyed):
    tmp_path, pairs, server_security = keyed
    context = zmq.Context()
    try:
        with SecureEchoServer("tcp://127.0.0.1:*", server_security, authenticate=False) as server:
            good = client_security(pairs["client"], server.endpoint, pairs["server"].public_key, tmp_path)
            with pytest.raises(ReplyTimeout):
                _ping(context, good, server.endpoint, 1, REFUSED_WAIT_S)
            assert server.num_handled == 0
    finally:
        context.term()


def test_reload_admits_a_newly_added_client(keyed):
    tmp_path, pairs, server_security = keyed
    context = zmq.Context()
    try:
        with SecureEchoServer("tcp://127.0.0.1:*", server_security) as server:
            newcomer = client_security(pairs["rogue"], server.endpoint, pairs["server"].public_key, tmp_path)
            with pytest.raises(ReplyTimeout):
                _ping(context, newcomer, server.endpoint, 1, REFUSED_WAIT_S)
            write_key_pair(tmp_path / "allowed", pairs["rogue"])
            server.authenticator.reload()
            assert "rogue" in server.authenticator.allowed_client_names
            assert _ping(context, newcomer, server.endpoint, 2, 5.0).nonce == 2
    finally:
        context.term()


def test_client_without_server_key_is_refused_before_connecting(keyed):
    tmp_path, pairs, _ = keyed
    security = client_security(pairs["client"], "tcp://127.0.0.1:1", pairs["server"].public_key, tmp_path)
    context = zmq.Context()
    with pytest.raises(KeyFileError, match="no server public key"):
        SyncClient("tcp://127.0.0.1:2", context=context, security=security)
    context.term()  # returns at once: the socket that could not be secured was closed
