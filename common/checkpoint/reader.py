"""Lazy, validated reading of hub-format DeepSeek-V4 checkpoints.

`CheckpointReader(path)` opens `model.safetensors` or the shards listed in
`model.safetensors.index.json` memory-mapped (`safetensors.safe_open`) and reads headers only.
Tensors are read when asked for, one entry at a time, so an expert worker reads just its
(layer, expert) pairs and an attention worker never touches a routed expert.

At open, every header is checked against `tensor_inventory(config)`: a missing tensor, a wrong
shape or a wrong dtype raises `CheckpointError` naming the tensor, the expectation and what was
found (missing `mtp.*` tensors are tolerated until `load_mtp`, because transformers'
`save_pretrained` drops them). Names written by `save_pretrained` (see `names_on_disk`) are
accepted; such checkpoints hold plain float tensors and are validated by shape, and any float
dtype is accepted for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from moemesh.common.checkpoint.errors import CheckpointError
from moemesh.common.model.inventory import SAFETENSORS_DTYPE_BYTES, StorageKind, StoredEntry, TensorSpec, stored_name_index, tensor_inventory
from moemesh.common.checkpoint.names_on_disk import EntryRef, ref_shape, resolve_entry
from moemesh.common.checkpoint.quant import dequantize_fp4, dequantize_fp8_block, e8m0_to_float
from moemesh.common.model.config import ModelConfig

log = structlog.get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("BF16", "F16", "F32")
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class QuantizedWeight:
    """Raw storage of one logical tensor, for kernels that consume quantized weights.

    `weight` is float8_e4m3fn [O, I] (FP8_BLOCK), int8 [O, I/2] (FP4_BLOCK) or a float/int tensor
    (unquantized kinds, `scale` None). `scale` is float8_e8m0fnu; `block_size` (rows, cols).
    """

    weight: torch.Tensor
    scale: torch.Tensor | None
    storage: StorageKind
    block_size: tuple[int, int] | None


@dataclass
class CheckReport:
    """Differences between a checkpoint and its inventory (all header-level)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def _checkpoint_files(path: Path) -> list[str]:
    index_path = path / INDEX_FILE
    if index_path.exists():
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (path / name).exists():
                raise CheckpointError(f"{INDEX_FILE} lists shard {name}, which is not in {path}")
        return files
    if (path / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _shard_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read, naming the first tensor it cuts short (None: no size problem)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{path.name}: {size} bytes, shorter than a safetensors header"
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            return f"{path.name}: header of {header_len} bytes runs past the end of the file ({size} bytes)"
        try:
            header = json.loads(handle.read(header_len))
        except ValueError as error:
            return f"{path.name}: header is not valid JSON ({error})"
    data_bytes = size - 8 - header_len
    entries = sorted(((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__"))
    for end, name in entries:
        if end > data_bytes:
            return (f"{name}: truncated in {path.name} (its data ends at byte {end} of the data section, "
                    f"which holds {data_bytes} bytes)")
    return None


def _open_shard(path: Path):
    """`safe_open` of one shard; a damaged file fails naming the tensor it cuts short."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # SafetensorError: say which tensor is affected where possible
        problem = _shard_problem(path)
        raise CheckpointError(problem or f"{path.name}: unreadable safetensors file ({error})") from None


class CheckpointReader:
    """Reads a checkpoint directory lazily; see the module docstring.

    `strict=False` keeps a checkpoint that does not match its inventory open (for inspection by
    `moemesh check-model`); the differences are in `report`, and reading a missing entry still fails.
    `num_entries_read` / `read_entry_names` count every safetensors entry actually read, so tests
    and tools can check what a loader touched. `on_progress(num_bytes, num_tensors)` receives the
    running totals after each entry.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        config: ModelConfig | None = None,
        on_progress: ProgressCallback | None = None,
        strict: bool = True,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        self._config = config if config is not None else ModelConfig.load(self.path)
        self._inventory = tensor_inventory(self._config)
        self._by_entry = stored_name_index(self._inventory)
        self.on_progress = on_progress
        self.num_entries_read = 0
        self.num_bytes_read = 0
        self.read_entry_names: list[str] = []
        self._handles = {name: _open_shard(self.path / name) for name in _checkpoint_files(self.path)}
        self._refs: dict[str, EntryRef] = {}
        self._found: dict[str, tuple[tuple[int, ...], str]] = {}  # hub entry -> (shape, dtype)
        self._unexpected: list[str] = []
        self.hub_named = True
        self._scan_headers()
        self.report = self._compare_with_inventory()
        problems = self.report.mismatched + [
            f"{name}: missing (expected {self._expected(name)})"
            for name in self.report.missing
            if not name.startswith("mtp.")
        ]
        if problems and strict:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointError(f"{self.path}: {problems[0]}{more}")
        if self.report.unexpected:
            log.warning("checkpoint.unexpected_tensors", path=str(self.path),
                        num_unexpected=len(self.report.unexpected), first=self.report.unexpected[:5])

    # ------------------------------------------------------------------ headers and validation
    def _scan_headers(self) -> None:
        known = set(self._by_entry)
        inter = self._config.moe_intermediate_size
        for file, handle in self._handles.items():
            for stored_name in handle.keys():
                view = handle.get_slice(stored_name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                refs = resolve_entry(stored_name, file, known, shape, inter)
                if not refs:
                    self._unexpected.append(stored_name)
                    continue
                if any(ref.hub_name != stored_name for ref in refs):
                    self.hub_named = False
                for ref in refs:
                    if ref.hub_name in self._refs:
                        raise CheckpointError(f"{ref.hub_name}: stored twice ({self._refs[ref.hub_name].stored_name}, {stored_name})")
                    self._refs[ref.hub_name] = ref
                    self._found[ref.hub_name] = (ref_shape(ref, shape), dtype)

    def _expected(self, entry_name: str) -> str:
        for entry in self._by_entry[entry_name].stored_entries():
            if entry.name == entry_name:
                return f"shape {list(entry.shape)} dtype {'/'.join(entry.dtypes)}"
        raise AssertionError(entry_name)

    def _compare_with_inventory(self) -> CheckReport:
        report = CheckReport(unexpected=list(self._unexpected))
        for spec in self._inventory.values():
            entries = spec.stored_entries()
            # a checkpoint written by transformers may hold a quantized tensor as plain floats
            if not self.hub_named and spec.is_quantized and entries[0].name in self._found \
                    and entries[1].name not in self._found and self._found[entries[0].name][1] in _FLOAT_DTYPES:
                entries = (StoredEntry(entries[0].name, spec.shape, _FLOAT_DTYPES),)
            for entry in entries:
                found = self._found.get(entry.name)
                if found is None:
                    report.missing.append(entry.name)
                    continue
                shape, dtype = found
                dtypes = entry.dtypes
                if not self.hub_named and dtypes[0] in _FLOAT_DTYPES:
                    dtypes = _FLOAT_DTYPES
                if shape != entry.shape or dtype not in dtypes:
                    report.mismatched.append(
                        f"{entry.name}: expected shape {list(entry.shape)} dtype {'/'.join(entry.dtypes)}, "
                        f"found shape {list(shape)} dtype {dtype}"
                    )
        return report

    # ------------------------------------------------------------------ queries
    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def inventory(self) -> dict[str, TensorSpec]:
        return self._inventory

    def tensor_names(self) -> list[str]:
        """Hub names of the stored entries present (weights and `.scale`s), inventory order."""
        return [entry.name for spec in self._inventory.values() for entry in spec.stored_entries()
                if entry.name in self._found]

    def found_dtype(self, entry_name: str) -> str | None:
        found = self._found.get(entry_name)
        return None if found is None else found[1]

    def stored_nbytes(self, entry_name: str) -> int:
        """Bytes of one stored entry (from its header); 0 when the entry is absent."""
        found = self._found.get(entry_name)
        if found is None:
            return 0
        shape, dtype = found
        count = 1
        for size in shape:
            count *= size
        return count * SAFETENSORS_DTYPE_BYTES[dtype]

    def logical_stored_nbytes(self, name: str) -> int:
        """Bytes on disk of the logical tensor `name`: its weight plus its scale when it has one."""
        spec = self._spec(name)
        return sum(self.stored_nbytes(entry.name) for entry in spec.stored_entries())

    def stored_kind(self, name: str) -> StorageKind:
        """How the logical tensor `name` is stored in this checkpoint: its inventory storage, or FLOAT
        for a quantized tensor held as plain floats (transformers' save format)."""
        spec = self._spec(name)
        if spec.is_quantized and (spec.scale_name not in self._refs
                                  or self.found_dtype(spec.name) in _FLOAT_DTYPES):
            return StorageKind.FLOAT
        return spec.storage

    def spec(self, name: str) -> TensorSpec:
        """The inventory entry of a logical tensor (hub or transformers name)."""
        return self._spec(name)

    # ------------------------------------------------------------------ reading
    def _read_entry(self, hub_entry_name: str) -> torch.Tensor:
        ref = self._refs.get(hub_entry_name)
        if ref is None:
            raise CheckpointError(f"{hub_entry_name}: missing from {self.path}")
        handle = self._handles[ref.file]
        if ref.expert is None:
            tensor = handle.get_tensor(ref.stored_name)
        else:
            view = handle.get_slice(ref.stored_name)
            if ref.rows is None:
                tensor = view[ref.expert]
            else:
                tensor = view[ref.expert, ref.rows[0]:ref.rows[1]]
            tensor = tensor.reshape(ref_shape(ref, tuple(view.get_shape())))
        self.num_entries_read += 1
        self.num_bytes_read += tensor.numel() * tensor.element_size()
        self.read_entry_names.append(hub_entry_name)
        if self.on_progress is not None:
            self.on_progress(self.num_bytes_read, self.num_entries_read)
        return tensor

    def _spec(self, name: str, inventory: dict[str, TensorSpec] | None = None) -> TensorSpec:
        inventory = self._inventory if inventory is None else inventory
        spec = inventory.get(name)
        if spec is None:
            spec = self._by_entry.get(name)
        if spec is None:
            refs = resolve_entry(name, "", set(self._by_entry), (), self._config.moe_intermediate_size)
            spec = self._by_entry.get(refs[0].hub_name) if len(refs) == 1 else None
        if spec is None:
            raise CheckpointError(f"{name}: not a tensor of this model (config from {self.path})")
        return spec

    def load_quantized(self, name: str) -> QuantizedWeight:
        """Raw storage (and scale) of the logical tensor `name`, no dequantization."""
        spec = self._spec(name)
        weight = self._read_entry(spec.name)
        scale = None
        if spec.is_quantized and spec.scale_name in self._refs:
            scale = self._read_entry(spec.scale_name)
        storage = spec.storage if scale is not None or not spec.is_quantized else StorageKind.FLOAT
        return QuantizedWeight(weight, scale, storage, spec.block_size if scale is not None else None)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor by hub (or transformers) name, dequantized to `dtype` (ints stay int64).

        A `.scale` name returns the scale multipliers as float32.
        """
        if name.endswith(".scale") or name.endswith(".weight_scale_inv"):
            spec = self._spec(name)
            return e8m0_to_float(self._read_entry(spec.scale_name))
        raw = self.load_quantized(name)
        if raw.storage is StorageKind.FP8_BLOCK:
            return dequantize_fp8_block(raw.weight, raw.scale, dtype, raw.block_size)
        if raw.storage is StorageKind.FP4_BLOCK:
            return dequantize_fp4(raw.weight, raw.scale, dtype)
        if raw.storage is StorageKind.I64:
            return raw.weight.to(torch.int64)
        return raw.weight.to(dtype)

    def _inventory_for(self, config: ModelConfig | None) -> dict[str, TensorSpec]:
        if config is None or config == self._config:
            return self._inventory
        return tensor_inventory(config)

    def load_attention_side(self, config: ModelConfig | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every tensor except routed experts and `mtp.*`, hub-named, dequantized to `dtype` (the
        single-process reference model; workers keep tensors quantized: `side_loading.py`).
        Never reads a routed-expert entry."""
        inventory = self._inventory_for(config)
        return {name: self.load(name, dtype) for name, spec in inventory.items() if spec.is_attention_side}

    def load_experts(
        self,
        config: ModelConfig | None,
        pairs: Iterable[tuple[int, int]],
        dtype: torch.dtype = torch.float32,
    ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(layer, expert) -> (w1 [I, D], w2 [D, I], w3 [I, D]) dequantized, reading only those experts (the
        single-process reference model; expert workers read into stacks: `expert_stacks.py`)."""
        inventory = self._inventory_for(config)
        out = {}
        for layer, expert in pairs:
            prefix = f"layers.{layer}.ffn.experts.{expert}."
            if prefix + "w1.weight" not in inventory:
                raise CheckpointError(f"{prefix}w1.weight: no routed expert ({layer}, {expert}) in this model")
            out[(layer, expert)] = tuple(self.load(prefix + f"{which}.weight", dtype) for which in ("w1", "w2", "w3"))
        return out

    def load_mtp(self, config: ModelConfig | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every `mtp.*` tensor (plain MTP block or DSpark stages), hub-named; raises if any is missing."""
        inventory = self._inventory_for(config)
        specs = [spec for spec in inventory.values() if spec.is_mtp]
        missing = [entry.name for spec in specs for entry in spec.stored_entries() if entry.name not in self._refs]
        if missing:
            raise CheckpointError(f"{missing[0]}: missing from {self.path} ({len(missing)} mtp.* entries missing)")
        return {spec.name: self.load(spec.name, dtype) for spec in specs}

    def load_all(self, dtype: torch.dtype = torch.float32, include_mtp: bool = False) -> dict[str, torch.Tensor]:
        """Everything (tiny models, tests): attention side, all routed experts, optionally mtp.*."""
        out = {name: self.load(name, dtype) for name, spec in self._inventory.items()
               if not spec.is_mtp or include_mtp}
        return out
