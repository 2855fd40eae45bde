"""Field schemas: each message's type hints compiled once into an encoder and a validating decoder.

The vocabulary (anything else is refused when the schema is compiled, i.e. in the tests):
int, float, bool, str, bytes, `X | None`, `tuple[X, ...]`, `tuple[X, Y]`, `dict[str, Any]`
(plain msgpack data, depth and size bounded), `StrEnum` subclasses, nested frozen
dataclasses (sent as maps by field name), and `Tensor` (a descriptor in the header plus a
raw frame, or inline bytes when small).

Decoding checks every value against its field's type and every size against `WireLimits`;
any mismatch raises WireError naming the path (`step_plan.sequences[3].token_ids`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from moemesh.common.wire.errors import WireError
from moemesh.common.wire.tensors import DTYPES


@dataclass(frozen=True)
class WireLimits:
    """Bounds a decoder enforces; a message outside them is refused as a whole."""

    max_message_bytes: int = 1 << 30  # header + all frames
    max_header_bytes: int = 16 << 20
    max_frames: int = 64
    max_ndim: int = 8
    max_items: int = 1 << 20  # length of any one sequence or map in the header
    max_str_bytes: int = 1 << 16
    max_plain_depth: int = 8  # nesting of dict[str, Any] payloads
    max_inline_tensor_bytes: int = 1024  # tensors up to this size travel inside the header


DEFAULT_LIMITS = WireLimits()


class TensorSlot:
    """Stands for `torch.Tensor` in type hints, so compiling schemas never imports torch."""


class EncodeContext:
    """Collects the raw frames of one message while its header is built."""

    def __init__(self, limits: WireLimits, tensor_writer: Callable[[Any], tuple] | None) -> None:
        self.limits = limits
        self.frames: list[Any] = []
        self.tensor_writer = tensor_writer


class DecodeContext:
    """The raw frames of one message; each must be referenced by exactly one tensor."""

    def __init__(self, frames: list[memoryview], limits: WireLimits) -> None:
        self.frames = frames
        self.limits = limits
        self.used = [False] * len(frames)


Encoder = Callable[[Any, str, EncodeContext], Any]
Decoder = Callable[[Any, str, DecodeContext], Any]


def _fail(path: str, expected: str, value: Any) -> WireError:
    return WireError(f"{path}: expected {expected}, got {type(value).__name__}")


# ---------------------------------------------------------------- scalars


# type hint -> (name in errors, the exact types accepted: no subclasses, so a bool is no int, and the
# conversion of an accepted value, None to pass it through)
_SCALARS: dict[type, tuple[str, tuple[type, ...], Callable[[Any], Any] | None]] = {
    bool: ("bool", (bool,), None),
    int: ("int", (int,), None),
    float: ("float", (float, int), float),
    bytes: ("bytes", (bytes, bytearray, memoryview), bytes),
}


def _scalar_codec(name: str, accepted: tuple[type, ...],
                  convert: Callable[[Any], Any] | None) -> tuple[Encoder, Decoder]:
    def check(value, path, ctx):
        if type(value) not in accepted:
            raise _fail(path, name, value)
        return value if convert is None else convert(value)

    return check, check


def _str_codec() -> tuple[Encoder, Decoder]:
    def check(value, path, ctx):
        if type(value) is not str:
            raise _fail(path, "str", value)
        if len(value) > ctx.limits.max_str_bytes:
            raise WireError(f"{path}: string longer than {ctx.limits.max_str_bytes}")
        return value

    return check, check


def _enum_codec(enum_cls: type[enum.Enum]) -> tuple[Encoder, Decoder]:
    def encode(value, path, ctx):
        if not isinstance(value, enum_cls):
            value = _decode_enum(value, path)
        return value.value

    def _decode_enum(value, path, ctx=None):
        try:
            return enum_cls(value)
        except (ValueError, TypeError):
            raise WireError(f"{path}: {value!r} is not a {enum_cls.__name__}") from None

    return encode, _decode_enum


def _plain_codec() -> tuple[Encoder, Decoder]:
    """`Any` inside dict[str, Any]: None, bool, int, float, str, lists and str-keyed maps."""

    def check(value, path, ctx, depth=0):
        if depth > ctx.limits.max_plain_depth:
            raise WireError(f"{path}: nested deeper than {ctx.limits.max_plain_depth}")
        if value is None or type(value) in (bool, int, float):
            return value
        if type(value) is str:
            return _str_codec()[0](value, path, ctx)
        if type(value) in (list, tuple):
            _check_len(value, path, ctx)
            return [check(item, f"{path}[{i}]", ctx, depth + 1) for i, item in enumerate(value)]
        if type(value) is dict:
            _check_len(value, path, ctx)
            out = {}
            for key, item in value.items():
                if type(key) is not str:
                    raise WireError(f"{path}: map keys must be str")
                out[key] = check(item, f"{path}.{key}", ctx, depth + 1)
            return out
        raise _fail(path, "plain data", value)

    return check, check


def _check_len(value, path: str, ctx) -> None:
    if len(value) > ctx.limits.max_items:
        raise WireError(f"{path}: {len(value)} items exceed the limit {ctx.limits.max_items}")


# ---------------------------------------------------------------- containers


def _optional_codec(inner: tuple[Encoder, Decoder]) -> tuple[Encoder, Decoder]:
    inner_encode, inner_decode = inner
    return (
        lambda value, path, ctx: None if value is None else inner_encode(value, path, ctx),
        lambda value, path, ctx: None if value is None else inner_decode(value, path, ctx),
    )


def _sequence_codec(inner: tuple[Encoder, Decoder]) -> tuple[Encoder, Decoder]:
    inner_encode, inner_decode = inner

    def encode(value, path, ctx):
        if type(value) not in (list, tuple):
            raise _fail(path, "a sequence", value)
        return [inner_encode(item, f"{path}[{i}]", ctx) for i, item in enumerate(value)]

    def decode(value, path, ctx):
        if type(value) is not list:
            raise _fail(path, "array", value)
        _check_len(value, path, ctx)
        return tuple(inner_decode(item, f"{path}[{i}]", ctx) for i, item in enumerate(value))

    return encode, decode


def _scalar_sequence_codec(scalar: type) -> tuple[Encoder, Decoder]:
    """tuple[int | float | bool | bytes, ...]: the element types checked in one pass over the sequence (token
    ids, draft distributions), the per-element codec only to name a bad element; the same values and errors."""
    _, accepted, convert = _SCALARS[scalar]
    accepted_types = frozenset(accepted)
    slow_encode, slow_decode = _sequence_codec(_scalar_codec(*_SCALARS[scalar]))

    def encode(value, path, ctx):
        if type(value) in (list, tuple) and accepted_types.issuperset(map(type, value)):
            return list(value) if convert is None else list(map(convert, value))
        return slow_encode(value, path, ctx)

    def decode(value, path, ctx):
        if type(value) is list and len(value) <= ctx.limits.max_items and accepted_types.issuperset(map(type, value)):
            return tuple(value) if convert is None else tuple(map(convert, value))
        return slow_decode(value, path, ctx)

    return encode, decode


def _fixed_tuple_codec(items: list[tuple[Encoder, Decoder]]) -> tuple[Encoder, Decoder]:
    def run(value, path, ctx, index, kinds):
        if type(value) not in kinds or len(value) != len(items):
            raise WireError(f"{path}: expected a {len(items)}-tuple")
        return [items[i][index](v, f"{path}[{i}]", ctx) for i, v in enumerate(value)]

    return (
        lambda value, path, ctx: run(value, path, ctx, 0, (list, tuple)),
        lambda value, path, ctx: tuple(run(value, path, ctx, 1, (list,))),
    )


def _dict_codec(inner: tuple[Encoder, Decoder]) -> tuple[Encoder, Decoder]:
    inner_encode, inner_decode = inner

    def run(value, path, ctx, convert):
        if type(value) is not dict:
            raise _fail(path, "map", value)
        _check_len(value, path, ctx)
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise WireError(f"{path}: map keys must be str")
            out[key] = convert(item, f"{path}.{key}", ctx)
        return out

    return (
        lambda value, path, ctx: run(value, path, ctx, inner_encode),
        lambda value, path, ctx: run(value, path, ctx, inner_decode),
    )


def _dataclass_codec(cls: type) -> tuple[Encoder, Decoder]:
    """A dataclass travels as a map {field name: value}. Unknown or missing fields are errors."""
    fields = dataclasses.fields(cls)
    hints = typing.get_type_hints(cls, localns={"Tensor": TensorSlot})
    names = [field.name for field in fields]
    required = {
        field.name
        for field in fields
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    codecs = {name: compile_type(hints[name]) for name in names}

    def encode(value, path, ctx):
        if type(value) is not cls:
            raise _fail(path, cls.__name__, value)
        return {name: codecs[name][0](getattr(value, name), f"{path}.{name}", ctx) for name in names}

    def decode(value, path, ctx):
        if type(value) is not dict:
            raise _fail(path, f"{cls.__name__} map", value)
        unknown = [key for key in value if key not in codecs]
        if unknown:
            raise WireError(f"{path}: unknown fields {sorted(map(str, unknown))[:5]}")
        missing = required.difference(value)
        if missing:
            raise WireError(f"{path}: missing fields {sorted(missing)}")
        kwargs = {key: codecs[key][1](item, f"{path}.{key}", ctx) for key, item in value.items()}
        return cls(**kwargs)

    return encode, decode


# ---------------------------------------------------------------- tensors


def _tensor_codec() -> tuple[Encoder, Decoder]:
    """Descriptor `[dtype, shape, frame]`: frame is an index into the raw frames, or the
    bytes themselves for tensors up to `max_inline_tensor_bytes`."""

    def encode(value, path, ctx: EncodeContext):
        from moemesh.common.wire import tensors

        if not tensors.is_tensor(value):
            raise _fail(path, "Tensor", value)
        writer = ctx.tensor_writer or tensors.to_buffer
        name, shape, buffer = writer(value)
        if len(buffer) <= ctx.limits.max_inline_tensor_bytes:
            return [name, list(shape), bytes(buffer)]
        ctx.frames.append(buffer)
        return [name, list(shape), len(ctx.frames) - 1]

    def decode(value, path, ctx: DecodeContext):
        if type(value) is not list or len(value) != 3:
            raise WireError(f"{path}: bad tensor descriptor")
        name, shape, where = value
        if type(name) is not str or name not in DTYPES:
            raise WireError(f"{path}: dtype {name!r} not allowed")
        if type(shape) is not list or len(shape) > ctx.limits.max_ndim:
            raise WireError(f"{path}: bad shape")
        if any(type(size) is not int or size < 0 for size in shape):
            raise WireError(f"{path}: shape sizes must be non-negative ints")
        num_bytes = math.prod(shape) * DTYPES[name][1]
        if num_bytes > ctx.limits.max_message_bytes:
            raise WireError(f"{path}: tensor of {num_bytes} bytes exceeds the message limit")
        if type(where) is bytes:
            buffer = memoryview(where)
        elif type(where) is int and 0 <= where < len(ctx.frames):
            if ctx.used[where]:
                raise WireError(f"{path}: frame {where} referenced twice")
            ctx.used[where] = True
            buffer = ctx.frames[where]
        else:
            raise WireError(f"{path}: bad frame reference")
        if len(buffer) != num_bytes:
            raise WireError(f"{path}: frame has {len(buffer)} bytes, {name}{shape} needs {num_bytes}")
        from moemesh.common.wire import tensors

        return tensors.from_buffer(name, tuple(shape), buffer)

    return encode, decode


# ---------------------------------------------------------------- compiler


def compile_type(tp: Any) -> tuple[Encoder, Decoder]:
    """(encoder, decoder) for one type hint from the vocabulary; TypeError for anything else."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is TensorSlot:
        return _tensor_codec()
    if tp is Any:
        return _plain_codec()
    if isinstance(tp, type) and tp in _SCALARS:
        return _scalar_codec(*_SCALARS[tp])
    if tp is str:
        return _str_codec()
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_codec(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_codec(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [arg for arg in args if arg is not type(None)]
        if len(non_none) == 1 and len(args) == 2:
            return _optional_codec(compile_type(non_none[0]))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            if isinstance(args[0], type) and args[0] in _SCALARS:
                return _scalar_sequence_codec(args[0])
            return _sequence_codec(compile_type(args[0]))
        return _fixed_tuple_codec([compile_type(arg) for arg in args])
    if origin is dict and args and args[0] is str:
        return _dict_codec(compile_type(args[1]))
    raise TypeError(f"type {tp!r} is not in the wire vocabulary")


@functools.cache
def message_codec(cls: type) -> tuple[Encoder, Decoder]:
    """The compiled (encoder, decoder) of a message class, built on first use and cached."""
    return _dataclass_codec(cls)
