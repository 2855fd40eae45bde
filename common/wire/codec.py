"""Message <-> frames: `[header, *tensor frames]`, header = msgpack `[type, version, fields]`.

No pickle, ever. The header carries every non-tensor field; each tensor is described in the
header by dtype and shape and travels as its own raw frame (tiny tensors inline). Decoding
validates everything before building a message (see `schema.py`) and raises WireError for
anything malformed, unknown, of another protocol version, or over the limits.

Torch is not imported here: a message without tensors encodes and decodes with msgpack
alone, so the router (which passes `accept=` a torch-free set of types) never loads torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack

from moemesh.common.wire.errors import WireError
from moemesh.common.wire.messages import ADMIN_MESSAGES, CONTROL_MESSAGES, MESSAGE_TYPES, PROTOCOL_VERSION
from moemesh.common.wire.schema import DEFAULT_LIMITS, DecodeContext, EncodeContext, WireLimits, message_codec

# Messages without tensor fields: what a torch-free process (the router) accepts.
TORCH_FREE_MESSAGES: frozenset[type] = frozenset(CONTROL_MESSAGES + ADMIN_MESSAGES)


def encode(
    message: Any,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    tensor_writer: Callable[[Any], tuple[str, tuple[int, ...], memoryview]] | None = None,
) -> list[bytes | memoryview]:
    """Frames of one message. `tensor_writer(tensor) -> (dtype name, shape, buffer)` decides
    where tensor bytes live (default: a view of the CPU tensor; a staging pool's writer
    copies into a pinned staging buffer instead)."""
    cls = type(message)
    tag = getattr(cls, "TYPE", None)
    if tag is None or MESSAGE_TYPES.get(tag) is not cls:
        raise WireError(f"{cls.__name__} is not a wire message")
    encoder, _ = message_codec(cls)
    context = EncodeContext(limits, tensor_writer)
    fields = encoder(message, tag, context)
    try:
        header = msgpack.packb([tag, PROTOCOL_VERSION, fields], use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as error:
        raise WireError(f"{tag}: cannot pack header: {error}") from None
    if len(header) > limits.max_header_bytes:
        raise WireError(f"{tag}: header of {len(header)} bytes exceeds {limits.max_header_bytes}")
    return [header, *context.frames]


def decode(
    frames: Sequence[Any],
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    accept: Iterable[type] | None = None,
) -> Any:
    """The message in `frames` (bytes, memoryviews or zmq.Frames), fully validated.

    `accept`: the message classes this receiver handles; anything else is a WireError
    before any tensor is touched. Tensors come back as CPU tensors viewing the frames.
    """
    if not frames:
        raise WireError("empty message")
    if len(frames) - 1 > limits.max_frames:
        raise WireError(f"{len(frames) - 1} frames exceed the limit {limits.max_frames}")
    buffers = [_as_buffer(frame) for frame in frames]
    total_bytes = sum(len(buffer) for buffer in buffers)
    if total_bytes > limits.max_message_bytes:
        raise WireError(f"message of {total_bytes} bytes exceeds {limits.max_message_bytes}")
    header = buffers[0]
    if len(header) > limits.max_header_bytes:
        raise WireError(f"header of {len(header)} bytes exceeds {limits.max_header_bytes}")
    try:
        unpacked = msgpack.unpackb(header, raw=False, use_list=True, strict_map_key=True)
    except Exception as error:  # msgpack raises many types for garbage; all mean "malformed"
        raise WireError(f"header is not valid msgpack: {type(error).__name__}") from None
    if type(unpacked) is not list or len(unpacked) != 3:
        raise WireError("header must be [type, version, fields]")
    tag, version, fields = unpacked
    cls = MESSAGE_TYPES.get(tag) if type(tag) is str else None
    if cls is None:
        raise WireError(f"unknown message type {tag!r:.60}")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise WireError(f"{tag}: protocol version {version!r:.20} is not {PROTOCOL_VERSION}")
    if accept is not None and cls not in accept:
        raise WireError(f"{tag} is not accepted by this receiver")
    _, decoder = message_codec(cls)
    context = DecodeContext(buffers[1:], limits)
    try:
        message = decoder(fields, tag, context)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RuntimeError) as error:
        # e.g. a dataclass or torch view refusing values the schema let through
        raise WireError(f"{tag}: {type(error).__name__}: {error}"[:300]) from None
    if not all(context.used):
        raise WireError(f"{tag}: frames not referenced by any tensor")
    return message


def _as_buffer(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame.cast("B") if frame.format != "B" or frame.ndim != 1 else frame
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    if buffer is None:
        raise WireError(f"frame of type {type(frame).__name__} is not a buffer")
    return buffer
