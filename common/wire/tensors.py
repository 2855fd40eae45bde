"""Tensor <-> raw frame conversion: the only part of the wire layer that imports torch.

The dtype whitelist and item sizes live here as plain data (no torch), so the codec can
validate a frame's byte count before anything imports torch. Only `to_buffer` and
`from_buffer` import torch, and only when a message actually carries a tensor; the router
never receives such messages (its decoder refuses data-plane types before this point).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# wire name -> (torch dtype attribute, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "bf16": ("bfloat16", 2),
    "f16": ("float16", 2),
    "f32": ("float32", 4),
    "i32": ("int32", 4),
    "i64": ("int64", 8),
    "u8": ("uint8", 1),
    "i8": ("int8", 1),
    "f8e4m3": ("float8_e4m3fn", 1),
    "bool": ("bool", 1),
}


def item_size(dtype_name: str) -> int:
    return DTYPES[dtype_name][1]


def torch_dtype(dtype_name: str) -> "torch.dtype":
    import torch

    return getattr(torch, DTYPES[dtype_name][0])


def dtype_name(dtype: "torch.dtype") -> str:
    """The wire name of a torch dtype; ValueError for a dtype outside the whitelist."""
    attribute = str(dtype).removeprefix("torch.")
    for name, (torch_attribute, _) in DTYPES.items():
        if torch_attribute == attribute:
            return name
    raise ValueError(f"dtype {dtype} is not allowed on the wire (allowed: {sorted(DTYPES)})")


def is_tensor(value: object) -> bool:
    """True for a torch.Tensor or a numpy ndarray (what a torch-free sender such as the router
    encodes), checked without importing either."""
    return any(cls.__module__ in ("torch", "numpy") and cls.__name__ in ("Tensor", "ndarray")
               for cls in type(value).__mro__)


def _numpy_to_buffer(array) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, bytes view) of a numpy array; dtypes as in DTYPES (no bfloat16, fp8)."""
    import numpy

    attribute = str(array.dtype)
    name = next((wire for wire, (torch_attribute, _) in DTYPES.items() if torch_attribute == attribute), None)
    if name is None:
        raise ValueError(f"dtype {attribute} is not allowed on the wire (allowed: {sorted(DTYPES)})")
    host = numpy.ascontiguousarray(array)
    return name, tuple(int(size) for size in host.shape), memoryview(host.reshape(-1).view(numpy.uint8)).cast("B")


def to_buffer(tensor: "torch.Tensor") -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, bytes view) of a tensor. A contiguous CPU tensor is viewed, not
    copied: the caller must keep it unchanged until the send completes (the staging pool
    exists for exactly that). Other tensors are copied to contiguous host memory first.
    A numpy array (little-endian, as every host moemesh runs on) is viewed the same way."""
    if type(tensor).__module__ == "numpy":
        return _numpy_to_buffer(tensor)
    name = dtype_name(tensor.dtype)
    shape = tuple(int(size) for size in tensor.shape)
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    host = host.contiguous()
    flat_bytes = host.reshape(-1).view(torch_dtype("u8"))  # [N * itemsize] u8
    return name, shape, memoryview(flat_bytes.numpy()).cast("B")


def from_buffer(dtype_name_: str, shape: tuple[int, ...], buffer: memoryview) -> "torch.Tensor":
    """A CPU tensor over `buffer` (no copy). The byte count was validated by the caller.

    A read-only buffer (a received ZeroMQ frame) gives a tensor that must not be written:
    callers that modify the result clone it or copy it to their device first.
    """
    import torch

    dtype = torch_dtype(dtype_name_)
    if len(buffer) == 0:
        return torch.empty(shape, dtype=dtype)
    if buffer.readonly:
        # torch.frombuffer warns (once) on read-only buffers; the memory is a live frame
        # that we only read, so the warning is noise here.
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(buffer, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
