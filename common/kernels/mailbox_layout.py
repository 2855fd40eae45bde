"""The CPU expert mailbox's shared memory: layout, sequence numbers, error words, the segment itself.

One segment per (waiting side, expert worker) pair, created by the waiting side (on a GPU host it will
register the same pages as host-mapped pinned memory) and attached by the worker. The layout is
defined here and in cpu_mailbox.h; `cpu_mailbox.load_mailbox` checks that the two agree, and the
worker checks the header of every segment it attaches. Protocol: docs/device-step.md.

Control page: int64 words, each side's words on their own 128-byte line (offsets below, bytes).
Data regions, page aligned: hidden [t_max, D] (fp32 or bf16), ids [t_max, K] int32, weights
[t_max, K] fp32, combine [t_max, D] fp32 partial sums (CombineMode.PARTIAL) or [t_max, K, D] fp32
per-slot outputs (CombineMode.SLOTS).
Legend: T rows of a step, K top-k slots, D hidden size, L layers, E routed experts.
"""

from __future__ import annotations

import enum
import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = 0x31584F424D454F4D  # "MOEMBOX1" read as a little-endian int64
VERSION = 1
PAGE_BYTES = 4096
CONTROL_BYTES = 4096
LAYER_BITS = 16
MAX_LAYERS = 1 << LAYER_BITS


class Word(enum.IntEnum):
    """Byte offsets of the control page's int64 words (cpu_mailbox.h MB_OFF_*)."""

    MAGIC = 0
    VERSION = 8
    T_MAX = 16
    HIDDEN_SIZE = 24
    TOP_K = 32
    HIDDEN_BF16 = 40
    COMBINE_SLOTS = 48
    TOTAL_BYTES = 56
    REGION_HIDDEN = 64
    REGION_IDS = 72
    REGION_WEIGHTS = 80
    REGION_COMBINE = 88
    WORKER_INDEX = 96
    DISPATCH_SEQ = 128  # waiting side, release store
    NUM_ROWS = 136  # waiting side, before the release
    DONE_SEQ = 256  # worker, release store
    WORKER_ERROR = 264  # worker, before the release
    WORKER_ERROR_SEQ = 272
    WORKER_ERROR_DETAIL = 280
    WAIT_ERROR = 384  # waiting side
    WAIT_ERROR_SEQ = 392
    WAIT_ERROR_SEEN = 400
    WAIT_ERROR_WORKER = 408
    STOP = 512  # controller
    WORKER_PID = 640  # worker status line
    WORKER_STATE = 648
    ATTACH_SEQ = 656
    SERVED = 664
    BUSY_NS = 672  # all layers served (ns)
    LAST_BUSY_NS = 680  # the last layer served (ns), written before done_seq


class MailboxError(enum.IntEnum):
    """Error word values (cpu_mailbox.h MB_ERR_*)."""

    OK = 0
    TIMEOUT = 1  # waiting side: no completion within the bound
    BAD_LAYER = 2  # worker: the seq's layer is outside the placement
    BAD_ROWS = 3  # worker: T outside 0..t_max
    BAD_EXPERT = 4  # worker: an expert id outside 0..E-1 (detail: the slot)
    KERNEL = 5  # worker: the FP4 kernel failed (detail: its status)
    PROTOCOL = 6  # waiting side: the completion seq passed the one waited for


class WorkerState(enum.IntEnum):
    DETACHED = 0
    WAITING = 1
    COMPUTING = 2
    STOPPED = 3


def abi_constants() -> list[int]:
    """The constants cpu_mailbox.c's moemesh_mailbox_abi reports, in its order."""
    return ([MAGIC, VERSION, PAGE_BYTES, CONTROL_BYTES, LAYER_BITS] + [int(w) for w in Word]
            + [int(e) for e in MailboxError] + [int(s) for s in WorkerState])


def make_seq(epoch: int, layer: int) -> int:
    """(epoch >= 1, layer) -> the int64 sequence number epoch << 16 | layer (grows along a run)."""
    if epoch < 1 or not 0 <= layer < MAX_LAYERS:
        raise ValueError(f"epoch {epoch} / layer {layer} out of range")
    return (epoch << LAYER_BITS) | layer


def split_seq(seq: int) -> tuple[int, int]:
    """seq -> (epoch, layer)."""
    return seq >> LAYER_BITS, seq & (MAX_LAYERS - 1)


class CombineMode(enum.Enum):
    """PARTIAL: each worker returns one partial sum per token (its owned slots added in slot order);
    the waiting side adds the workers' partials in worker order, so results equal the in-process sum
    to rounding when a token's slots are spread over workers (bitwise when K <= 2 or one worker owns
    them all). SLOTS: each worker returns its owned slots' outputs [T, K, D]; the waiting side takes
    every slot from its owner and adds the K slots in slot order, bitwise the in-process result
    whatever the placement (K times the bytes back)."""

    PARTIAL = 0
    SLOTS = 1


def _page_up(num_bytes: int) -> int:
    return (num_bytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


@dataclass(frozen=True)
class MailboxLayout:
    """Shapes of one mailbox; offsets derived once (checked against cpu_mailbox.c's)."""

    t_max: int
    hidden_size: int
    top_k: int
    hidden_bf16: bool = False
    combine: CombineMode = CombineMode.PARTIAL

    def __post_init__(self) -> None:
        if self.t_max < 1 or self.hidden_size < 32 or self.hidden_size % 32 or self.top_k < 1:
            raise ValueError(f"bad mailbox shape: t_max {self.t_max}, hidden {self.hidden_size}, top_k {self.top_k}")

    @property
    def hidden_dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.hidden_bf16 else np.float32)  # bf16 travels as its 16 bits

    @property
    def combine_shape(self) -> tuple[int, ...]:
        if self.combine is CombineMode.SLOTS:
            return (self.t_max, self.top_k, self.hidden_size)
        return (self.t_max, self.hidden_size)

    @property
    def regions(self) -> tuple[int, int, int, int, int]:
        """(hidden, ids, weights, combine, total) byte offsets."""
        hidden_bytes = self.t_max * self.hidden_size * (2 if self.hidden_bf16 else 4)
        route_bytes = self.t_max * self.top_k * 4
        combine_bytes = int(np.prod(self.combine_shape)) * 4
        hidden = CONTROL_BYTES
        ids = hidden + _page_up(hidden_bytes)
        weights = ids + _page_up(route_bytes)
        combine = weights + _page_up(route_bytes)
        return hidden, ids, weights, combine, combine + _page_up(combine_bytes)

    @property
    def total_bytes(self) -> int:
        return self.regions[4]

    def header_words(self, worker_index: int) -> dict[Word, int]:
        hidden, ids, weights, combine, total = self.regions
        return {Word.MAGIC: MAGIC, Word.VERSION: VERSION, Word.T_MAX: self.t_max, Word.HIDDEN_SIZE: self.hidden_size,
                Word.TOP_K: self.top_k, Word.HIDDEN_BF16: int(self.hidden_bf16),
                Word.COMBINE_SLOTS: int(self.combine is CombineMode.SLOTS), Word.TOTAL_BYTES: total,
                Word.REGION_HIDDEN: hidden, Word.REGION_IDS: ids, Word.REGION_WEIGHTS: weights,
                Word.REGION_COMBINE: combine, Word.WORKER_INDEX: worker_index}

    @classmethod
    def from_words(cls, words: np.ndarray) -> MailboxLayout:
        """The layout a segment's header describes (checked against its own offsets)."""
        def word(w: Word) -> int:
            return int(words[w // 8])

        if word(Word.MAGIC) != MAGIC or word(Word.VERSION) != VERSION:
            raise ValueError(f"not a mailbox segment of version {VERSION} (magic {word(Word.MAGIC):#x}, "
                             f"version {word(Word.VERSION)})")
        layout = cls(word(Word.T_MAX), word(Word.HIDDEN_SIZE), word(Word.TOP_K), bool(word(Word.HIDDEN_BF16)),
                     CombineMode(word(Word.COMBINE_SLOTS)))
        for key, value in layout.header_words(word(Word.WORKER_INDEX)).items():
            if word(key) != value:
                raise ValueError(f"segment header {key.name} is {word(key)}, the layout says {value}")
        return layout


def default_segment_dir() -> Path:
    """/dev/shm where it exists (memory, not disk), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class MailboxSegment:
    """A mailbox's shared pages, mapped into this process: `create` (the waiting side: a new file,
    header written, unlinked again by `close(unlink=True)`) or `attach` (a worker, by path).

    Views: `words` (the control page as int64), `hidden`, `ids`, `weights`, `combine` (numpy arrays
    over the shared pages). `address` is the base pointer handed to the native code."""

    def __init__(self, path: Path, layout: MailboxLayout, owner: bool) -> None:
        self.path = path
        self.layout = layout
        self.owner = owner
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self._bytes.ctypes.data
        hidden, ids, weights, combine, _ = layout.regions
        t_max, top_k, dim = layout.t_max, layout.top_k, layout.hidden_size
        self.words = self._bytes[:CONTROL_BYTES].view(np.int64)
        self.hidden = self._bytes[hidden:hidden + t_max * dim * layout.hidden_dtype.itemsize].view(
            layout.hidden_dtype).reshape(t_max, dim)
        self.ids = self._bytes[ids:ids + t_max * top_k * 4].view(np.int32).reshape(t_max, top_k)
        self.weights = self._bytes[weights:weights + t_max * top_k * 4].view(np.float32).reshape(t_max, top_k)
        num_combine = int(np.prod(layout.combine_shape))
        self.combine = self._bytes[combine:combine + num_combine * 4].view(np.float32).reshape(layout.combine_shape)

    @classmethod
    def create(cls, layout: MailboxLayout, worker_index: int, directory: Path | None = None,
               name: str | None = None) -> MailboxSegment:
        """A new zeroed segment with its header written (the waiting side's job)."""
        path = (directory or default_segment_dir()) / (name or f"moemesh-mailbox-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
        finally:
            os.close(fd)
        segment = cls(path, layout, owner=True)
        for key, value in layout.header_words(worker_index).items():
            segment.words[key // 8] = value
        return segment

    @classmethod
    def attach(cls, path: str | Path) -> MailboxSegment:
        """Maps an existing segment; raises ValueError when its header is not a valid mailbox layout."""
        path = Path(path)
        with open(path, "rb") as handle:
            header = np.frombuffer(handle.read(CONTROL_BYTES), dtype=np.int64)
        if header.size * 8 < CONTROL_BYTES:
            raise ValueError(f"{path}: too short for a mailbox header")
        layout = MailboxLayout.from_words(header)
        if path.stat().st_size < layout.total_bytes:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, the layout needs {layout.total_bytes}")
        return cls(path, layout, owner=False)

    def word(self, which: Word) -> int:
        return int(self.words[which // 8])

    def set_word(self, which: Word, value: int) -> None:
        """A plain store (not for the flag words: those go through the native release store)."""
        self.words[which // 8] = value

    def word_address(self, which: Word) -> int:
        return self.address + int(which)

    @property
    def worker_index(self) -> int:
        return self.word(Word.WORKER_INDEX)

    def close(self, unlink: bool | None = None) -> None:
        """Unmaps (views must be dropped first); the creator unlinks the file unless unlink=False."""
        for name in ("words", "hidden", "ids", "weights", "combine", "_bytes"):
            self.__dict__.pop(name, None)
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view: leave the mapping to the garbage collector
            pass
        if (self.owner if unlink is None else unlink) and self.path.exists():
            self.path.unlink()
