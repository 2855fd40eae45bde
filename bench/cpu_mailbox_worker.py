"""A CPU mailbox worker as a process of its own, serving random-weight FP4 experts (tests, benchmark).

`python -m moemesh.bench.cpu_mailbox_worker '<WorkerSpec as JSON>'` builds the layers' expert stacks
from a seed (the same bytes in every process that uses the seed), and for every (segment, owner
table) it is named keeps the experts that table gives it and starts one native worker thread on
that segment; it exits once every segment's stop word is set. Python does nothing in between: the loop is cpu_mailbox.c's.
Legend: L layers, E routed experts, D hidden, I expert width.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moemesh.common.kernels.cpu_fp4 import ExpertStacks

_PR_SET_PDEATHSIG = 1
FP4Layer = tuple[torch.Tensor, ...]  # w1, s1, w3, s3, w2, s2 stacked over E experts


def random_layers(seed: int, num_layers: int, num_experts: int, hidden_size: int, inter_size: int) -> list[FP4Layer]:
    """Every layer's E experts: w1/w3 [E, I, D/2] + scales [E, I, D/32], w2 [E, D, I/2] + [E, D, I/32]."""
    from moemesh.common.model.random_init import random_fp4_stack

    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        w1, s1 = random_fp4_stack(num_experts, inter_size, hidden_size, generator=generator)
        w3, s3 = random_fp4_stack(num_experts, inter_size, hidden_size, generator=generator)
        w2, s2 = random_fp4_stack(num_experts, hidden_size, inter_size, generator=generator)
        layers.append((w1, s1, w3, s3, w2, s2))
    return layers


def owned_stacks(layers: list[FP4Layer], local: torch.Tensor) -> list[ExpertStacks | None]:
    """The experts `local` [L, E] marks owned (stack index >= 0, ascending expert id), per layer."""
    stacks: list[ExpertStacks | None] = []
    for layer, tensors in enumerate(layers):
        (owned,) = torch.where(local[layer] >= 0)
        stacks.append(ExpertStacks.from_tensors(*(t[owned].contiguous() for t in tensors)) if owned.numel() else None)
    return stacks


@dataclass(frozen=True)
class WorkerSpec:
    mailboxes: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]  # (segment path, owner [L][E]) per thread
    worker_index: int
    seed: int
    hidden_size: int
    inter_size: int
    swiglu_limit: float | None = None
    route_before_w2: bool = False
    num_threads: int = 1
    spin_us: float = 20.0
    sleep_min_us: float = 2.0
    sleep_max_us: float = 200.0
    pin_cpu: int | None = None
    die_with_parent: bool = True  # Linux: the kernel kills this process when its parent exits

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        raw["mailboxes"] = tuple((path, tuple(tuple(row) for row in owner)) for path, owner in raw["mailboxes"])
        return cls(**raw)


def spawn_worker(spec: WorkerSpec, repo_root: Path | None = None) -> subprocess.Popen:
    """Starts `python -m moemesh.bench.cpu_mailbox_worker` for `spec` (stdout: one JSON line at exit)."""
    root = repo_root or Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "moemesh.bench.cpu_mailbox_worker", spec.to_json()], env=env,
                            stdout=subprocess.PIPE, text=True)


def main(argv: list[str]) -> int:
    from moemesh.common.kernels.cpu_mailbox import (IDLE_WAIT, ExpertMath, MailboxWorker, WaitConfig, load_mailbox,
                                            owned_local_table)
    from moemesh.common.kernels.mailbox_layout import MailboxSegment, Word

    spec = WorkerSpec.from_json(argv[0])
    if spec.die_with_parent and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    torch.set_num_threads(1)
    owners = [torch.tensor(owner, dtype=torch.int64) for _, owner in spec.mailboxes]
    layers = random_layers(spec.seed, owners[0].shape[0], owners[0].shape[1], spec.hidden_size, spec.inter_size)
    library = load_mailbox()
    wait = WaitConfig(spec.spin_us, spec.sleep_min_us, spec.sleep_max_us)
    math = ExpertMath(spec.swiglu_limit, spec.route_before_w2)
    segments, workers = [], []
    for (path, _), owner in zip(spec.mailboxes, owners):
        local = owned_local_table(owner, spec.worker_index)
        segments.append(MailboxSegment.attach(path))
        workers.append(MailboxWorker(library, segments[-1], owned_stacks(layers, local), local, math,
                                     spec.num_threads, wait, spec.pin_cpu))
    del layers
    counts = []
    for segment, worker in zip(segments, workers):
        library.wait(segment.word_address(Word.STOP), 1, -1.0, IDLE_WAIT)
        counts.append(worker.stop())
    print(json.dumps({"served": [c[0] for c in counts], "failed": [c[1] for c in counts]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
