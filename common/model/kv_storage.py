"""Which format the KV rows (window, compressed and CSA indexer rows) are stored in: the `kv_dtype` setting.

Torch-free, so the deployment loader and the command line can validate the setting without loading torch;
the formats themselves are in `common/model/kv_rows.py`.
- `bf16`: rows in the activation dtype (bf16 on GPUs, fp32 on the CPU), 2 or 4 bytes a channel;
- `fp8`: the production FP8 row (e4m3 non-rotary channels in blocks of 64 with a ue8m0 scale each,
  rotary channels in bf16): 584 bytes per V4-Flash row instead of 1,024 in bf16; the CSA indexer's rows as
  132-byte FP8 rows (128 e4m3 channels, one fp32 power-of-two scale) instead of 256.
The compressors' pending inputs are not affected.
"""

from __future__ import annotations

import enum


class KVStorage(enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"


KV_DTYPES = tuple(storage.value for storage in KVStorage)  # the accepted `kv_dtype` values


def parse_kv_storage(value: object, key: str = "kv_dtype") -> KVStorage:
    """The storage a `kv_dtype` value names; ValueError naming `key` otherwise."""
    if isinstance(value, KVStorage):
        return value
    if isinstance(value, str) and value in KV_DTYPES:
        return KVStorage(value)
    raise ValueError(f"{key}: {value!r} is not one of {', '.join(KV_DTYPES)}")
