"""CURVE key pairs: generate, write, load, and apply to ZeroMQ sockets.

Every moemesh service has its own key pair, named after the service (`router`,
`attention-0`, `expert-cuda1`, `draft`). On disk a key pair is two files in ZeroMQ's
certificate format (ZPL, the format `zmq.auth.create_certificates` writes and
`zmq.auth.load_certificate` reads), in a keys directory:

    <name>.key          public key only; mode 0644; copy it to every host
    <name>.key_secret   public and secret key; mode 0600; stays on the host that runs <name>

A secret file readable by group or others is refused on load (as ssh does): a secret
that leaked through permissions is not a secret.

Keys are kept as their 40-character Z85 text (bytes), the form ZeroMQ's socket options take.
On a server socket CURVE is applied together with a ZAP domain and ZAP_ENFORCE_DOMAIN, so a
server whose process runs no authenticator refuses every client instead of admitting all
(fail closed); `authenticator.ClientAuthenticator` is what admits the allowed ones.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

Z85_KEY_LENGTH = 40  # a 32-byte Curve25519 key in Z85 text
ZAP_DOMAIN = "moemesh"  # the ZAP domain every moemesh server socket announces
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
PUBLIC_FILE_MODE = 0o644
SECRET_FILE_MODE = 0o600
KEYS_DIR_MODE = 0o700

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_KEY_LINE = re.compile(r'^\s*(public-key|secret-key)\s*=\s*"([^"]*)"\s*$')


class KeyFileError(ValueError):
    """A key file that is missing, malformed or too widely readable; the message names the file."""


def check_key_name(name: str) -> str:
    """A key name becomes a file name: letters, digits, `_.-`, not starting with a dot."""
    if not _NAME.match(name):
        raise ValueError(f"{name!r}: key names are letters, digits, '_', '.', '-' (not starting with '.' or '-')")
    return name


def check_z85_key(key: bytes, what: str) -> bytes:
    """`key` as 40 bytes of Z85 text that decodes to 32 bytes; ValueError otherwise."""
    if isinstance(key, str):
        key = key.encode("ascii")
    if len(key) != Z85_KEY_LENGTH:
        raise ValueError(f"{what}: a CURVE key is {Z85_KEY_LENGTH} Z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"{what}: not valid Z85 text") from None
    return key


@dataclass(frozen=True)
class CurveKeyPair:
    """One service's key pair in Z85 text. `secret_key` is None for a public-only key
    (a peer's). The secret never appears in repr, so logging a config cannot leak it."""

    name: str
    public_key: bytes
    secret_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_key_name(self.name)
        check_z85_key(self.public_key, f"{self.name} public key")
        if self.secret_key is not None:
            check_z85_key(self.secret_key, f"{self.name} secret key")

    def require_secret(self) -> bytes:
        if self.secret_key is None:
            raise KeyFileError(f"{self.name}: only the public key is loaded; the secret key is needed here")
        return self.secret_key


@dataclass(frozen=True)
class KeyFilePaths:
    public_path: Path
    secret_path: Path


def generate_key_pair(name: str) -> CurveKeyPair:
    """A fresh Curve25519 key pair from libzmq (`zmq.curve_keypair`)."""
    public_key, secret_key = zmq.curve_keypair()
    return CurveKeyPair(name=check_key_name(name), public_key=public_key, secret_key=secret_key)


def key_file_paths(keys_dir: str | Path, name: str) -> KeyFilePaths:
    keys_dir = Path(keys_dir)
    check_key_name(name)
    return KeyFilePaths(public_path=keys_dir / (name + PUBLIC_SUFFIX), secret_path=keys_dir / (name + SECRET_SUFFIX))


def write_key_pair(keys_dir: str | Path, pair: CurveKeyPair, *, overwrite: bool = False) -> KeyFilePaths:
    """Write `<name>.key` (0644) and `<name>.key_secret` (0600) into keys_dir.

    The secret file is created with its final mode (no window in which it is readable),
    and existing files are refused unless `overwrite` (a replaced key locks out every peer
    that still holds the old public key). A new keys_dir is created with mode 0700.
    """
    secret_key = pair.require_secret()
    paths = key_file_paths(keys_dir, pair.name)
    Path(keys_dir).mkdir(mode=KEYS_DIR_MODE, parents=True, exist_ok=True)
    if not overwrite:
        for path in (paths.public_path, paths.secret_path):
            if path.exists():
                raise FileExistsError(f"{path} exists; pass overwrite (--force) to replace the key pair")
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    header = f"#   ****  Generated on {created} by moemesh keys generate  ****\n"
    metadata = f'metadata\n    name = "{pair.name}"\n'
    public_text = (
        f"{header}#   ZeroMQ CURVE Public Certificate\n"
        "#   Exchange securely, or use a secure mechanism to verify the contents\n"
        "#   of this file after exchange. Store public certificates in your home\n"
        "#   directory, in the .curve subdirectory.\n\n"
        f'{metadata}curve\n    public-key = "{pair.public_key.decode("ascii")}"\n'
    )
    secret_text = (
        f"{header}#   ZeroMQ CURVE **Secret** Certificate\n"
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n"
        f'{metadata}curve\n    public-key = "{pair.public_key.decode("ascii")}"\n'
        f'    secret-key = "{secret_key.decode("ascii")}"\n'
    )
    _write_new_file(paths.secret_path, secret_text, SECRET_FILE_MODE)
    _write_new_file(paths.public_path, public_text, PUBLIC_FILE_MODE)
    return paths


def _write_new_file(path: Path, text: str, mode: int) -> None:
    """Create `path` with exactly `mode` (umask cannot widen it; fchmod makes it exact)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(descriptor, mode)
        os.write(descriptor, text.encode("ascii"))
    finally:
        os.close(descriptor)


def _read_keys(path: Path) -> dict[str, bytes]:
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise KeyFileError(f"{path}: cannot read: {error}") from None
    found: dict[str, bytes] = {}
    for line in text.splitlines():
        match = _KEY_LINE.match(line)
        if match is not None:
            try:
                found[match.group(1)] = check_z85_key(match.group(2).encode("ascii"), f"{path}: {match.group(1)}")
            except (ValueError, UnicodeEncodeError) as error:
                raise KeyFileError(str(error)) from None
    if "public-key" not in found:
        raise KeyFileError(f"{path}: no public-key line (expected ZeroMQ certificate format)")
    return found


def load_public_key(path: str | Path) -> bytes:
    """The Z85 public key of a `.key` (or `.key_secret`) file."""
    return _read_keys(Path(path))["public-key"]


def load_key_pair(keys_dir: str | Path, name: str) -> CurveKeyPair:
    """This service's own key pair from `<keys_dir>/<name>.key_secret` (mode must be 0600 or tighter)."""
    path = key_file_paths(keys_dir, name).secret_path
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file (run `moemesh keys generate --out {keys_dir} --name {name}`)") from None
    if mode & 0o077:
        raise KeyFileError(f"{path}: secret key file has mode {mode:04o}, readable beyond its owner; chmod 600 it")
    keys = _read_keys(path)
    if "secret-key" not in keys:
        raise KeyFileError(f"{path}: no secret-key line")
    return CurveKeyPair(name=name, public_key=keys["public-key"], secret_key=keys["secret-key"])


def load_public_keys(directory: str | Path) -> dict[str, bytes]:
    """name -> Z85 public key for every `<name>.key` in directory (secret files are not read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KeyFileError(f"{directory}: not a directory of public keys")
    keys = {}
    for path in sorted(directory.glob("*" + PUBLIC_SUFFIX)):
        keys[path.name[: -len(PUBLIC_SUFFIX)]] = load_public_key(path)
    return keys


# ------------------------------------------------------------------ sockets


def apply_server_keys(socket: zmq.Socket, own: CurveKeyPair) -> None:
    """Make `socket` a CURVE server; call before bind. Clients are checked by the ZAP handler
    of the socket's context, and with ZAP_ENFORCE_DOMAIN a missing handler means refusal."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, own.require_secret())
    socket.setsockopt(zmq.CURVE_PUBLICKEY, own.public_key)
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode("ascii"))
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def apply_client_keys(socket: zmq.Socket, own: CurveKeyPair, server_public_key: bytes) -> None:
    """Make `socket` a CURVE client of the server whose public key is given; call before connect.
    A server presenting another key fails the handshake: the client authenticates the server too."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, check_z85_key(server_public_key, "server public key"))
    socket.setsockopt(zmq.CURVE_PUBLICKEY, own.public_key)
    socket.setsockopt(zmq.CURVE_SECRETKEY, own.require_secret())
