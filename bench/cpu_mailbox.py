"""Round trip and hop cost per layer of the CPU expert mailbox (cpu_mailbox.c) on this host.

A worker process (`bench.cpu_mailbox_worker`, the native loop) serves one segment at V4-Flash
activation shapes (D 4096, top-6, t_max 64, partial-sum combine); this process plays the device side
with `MailboxDriver`'s pieces, one layer at a time, L layers a step:
  write slot (hidden [T, D] fp32, ids, weights) | post (T, release dispatch_seq) | wait for done_seq |
  read the combine slot and add it (fixed order).
Modes: `echo` (the worker owns no expert of the layer: it checks the slot, zeroes the rows and
answers; the pure mailbox round trip) and `experts` (it owns all E small FP4 experts, width I; the
hop beside real compute). Waits: `backoff` (spin 20 us, then sleeps 2 us doubling to 200 us: the
default, for hosts whose cores are shared) and `spin` (both sides spin; a core each is assumed).
Per (mode, wait, T), medians over every measured layer, microseconds:
  round_trip_us  post + wait (flag to the worker, its work, flag back)
  worker_us      the worker's own time on the layer (its last-layer word, read after done_seq)
  hop_us         round_trip - worker, per layer: both one-way flag latencies and wake-ups
  layer_us       the whole layer on this side (slot write, round trip, combine) ; step_ms = L x that
`--waiting-side cpu` (default): the device side is Python (a CPU stand-in). `--waiting-side gpu`: the
device side is a CUDA graph of the L layers (common/kernels/mailbox_gpu.py: post, spin-wait with a
timeout, read the combine region, add), replayed once per step; the segment is registered with
CUDA. Then layer_us = step time (CUDA events) / L, worker_us = the worker's busy time per layer
served, hop_us = layer_us - worker_us (slot write over PCIe, both flags, the read back).
Figures depend on what else runs on the host: the JSON records the load average before and after.

    python -m moemesh.bench.cpu_mailbox                      # T 1,8,64; echo and experts; backoff and spin
    python -m moemesh.bench.cpu_mailbox --T 1 --modes echo --waits spin --steps 5
    python -m moemesh.bench.cpu_mailbox --waiting-side gpu --waits spin   # on a GPU host
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from moemesh.bench.results_io import write_result
from moemesh.bench.timing import median, percentile, time_s
from moemesh.common.kernels.cpu_mailbox import WaitConfig, load_mailbox
from moemesh.common.kernels.mailbox_driver import MailboxDriver, wait_until_attached
from moemesh.common.kernels.mailbox_layout import CombineMode, MailboxLayout, MailboxSegment, Word, make_seq
from moemesh.bench.cpu_mailbox_worker import WorkerSpec, spawn_worker

HIDDEN, TOP_K, T_MAX = 4096, 6, 64
WAITS = {"backoff": WaitConfig(), "spin": WaitConfig(spin_us=10_000_000.0)}


def _spawn_worker(segment: MailboxSegment, mode: str, wait: WaitConfig, args):
    """The worker process serving `segment`: it owns every expert (`experts`) or none (`echo`)."""
    owned_by = 0 if mode == "experts" else 1  # echo: the worker (index 0) owns nothing
    owner_rows = tuple(tuple([owned_by] * args.experts) for _ in range(args.layers))
    spec = WorkerSpec(((str(segment.path), owner_rows),), 0, seed=3, hidden_size=HIDDEN, inter_size=args.inter,
                      swiglu_limit=10.0, num_threads=args.threads, spin_us=wait.spin_us,
                      sleep_min_us=wait.sleep_min_us, sleep_max_us=wait.sleep_max_us, pin_cpu=args.worker_cpu)
    return spawn_worker(spec)


def _stop_worker(segment: MailboxSegment, process) -> None:
    segment.set_word(Word.STOP, 1)
    try:
        process.communicate(timeout=60)
    except Exception:
        process.kill()
        process.communicate()


def run_case(library, mode: str, wait_name: str, num_tokens_list: list[int], args) -> list[dict]:
    wait = WAITS[wait_name]
    layout = MailboxLayout(T_MAX, HIDDEN, TOP_K, False, CombineMode.PARTIAL)
    segment = MailboxSegment.create(layout, 0)
    num_experts = args.experts
    process = _spawn_worker(segment, mode, wait, args)
    records = []
    try:
        wait_until_attached(segment, process.pid, 300.0)
        driver = MailboxDriver(library, [segment], torch.zeros(args.layers, num_experts, dtype=torch.int64),
                               timeout_s=10.0, wait=wait)
        generator = torch.Generator().manual_seed(1)
        for num_tokens in num_tokens_list:
            hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
            ids = torch.stack([torch.randperm(num_experts, generator=generator)[:TOP_K] for _ in range(num_tokens)])
            weights = torch.rand(num_tokens, TOP_K, generator=generator)
            steps = args.steps if mode == "echo" else max(2, args.steps // 4)
            samples = {"round_trip": [], "worker": [], "hop": [], "layer": [], "write": [], "combine": []}
            served0 = 0
            step_ms = []
            for step in range(args.warmup + steps):
                if step == args.warmup:
                    served0 = segment.word(Word.SERVED)
                    for values in samples.values():
                        values.clear()
                    step_ms.clear()
                driver.epoch += 1
                step_start = time.perf_counter_ns()
                for layer in range(args.layers):
                    seq = make_seq(driver.epoch, layer)
                    t0 = time.perf_counter_ns()
                    driver.write_slot(segment, hidden, ids, weights)
                    t1 = time.perf_counter_ns()
                    library.post(segment, seq, num_tokens)
                    failure = driver.await_worker(0, layer, seq)
                    t2 = time.perf_counter_ns()
                    if failure is not None:
                        raise RuntimeError(failure.describe())
                    worker_ns = segment.word(Word.LAST_BUSY_NS)  # written before done_seq: this layer's
                    share = torch.from_numpy(segment.combine[:num_tokens]).clone()
                    driver.combine(layer, ids, {0: share}, num_tokens, HIDDEN)
                    t3 = time.perf_counter_ns()
                    samples["write"].append((t1 - t0) / 1e3)
                    samples["round_trip"].append((t2 - t1) / 1e3)
                    samples["worker"].append(worker_ns / 1e3)
                    samples["hop"].append((t2 - t1 - worker_ns) / 1e3)
                    samples["combine"].append((t3 - t2) / 1e3)
                    samples["layer"].append((t3 - t0) / 1e3)
                step_ms.append((time.perf_counter_ns() - step_start) / 1e6)
            served = segment.word(Word.SERVED) - served0
            record = {"mode": mode, "wait": wait_name, "T": num_tokens, "layers": args.layers, "steps": steps,
                      "experts_owned": num_experts if mode == "experts" else 0, "inter": args.inter,
                      "worker_threads": args.threads, "layers_served": served,
                      "round_trip_us": median(samples["round_trip"]),
                      "round_trip_p90_us": percentile(samples["round_trip"], 0.9),
                      "worker_us": median(samples["worker"]), "hop_us": median(samples["hop"]),
                      "hop_p90_us": percentile(samples["hop"], 0.9),
                      "write_us": median(samples["write"]), "combine_us": median(samples["combine"]),
                      "layer_us": median(samples["layer"]), "step_ms": median(step_ms)}
            records.append(record)
            print(f"{mode:8s} {wait_name:8s} T={num_tokens:3d}: round trip {record['round_trip_us']:8.1f} us "
                  f"(p90 {record['round_trip_p90_us']:8.1f}), worker {record['worker_us']:8.1f}, hop {record['hop_us']:7.1f}, "
                  f"layer {record['layer_us']:8.1f} us, step {record['step_ms']:7.2f} ms", flush=True)
    finally:
        _stop_worker(segment, process)
        segment.close()
    return records


def run_gpu_case(library, mode: str, wait_name: str, num_tokens_list: list[int], args) -> list[dict]:
    """The same layers with a CUDA graph as the waiting side (one replay per step)."""
    from moemesh.common.kernels.mailbox_gpu import GpuMailbox, advance_epoch, register_host_segment, unregister_host_segment

    wait = WAITS[wait_name]
    device = torch.device("cuda", 0)
    layout = MailboxLayout(T_MAX, HIDDEN, TOP_K, False, CombineMode.PARTIAL)
    segment = MailboxSegment.create(layout, 0)
    register_host_segment(segment)
    num_experts = args.experts
    process = _spawn_worker(segment, mode, wait, args)
    records = []
    try:
        wait_until_attached(segment, process.pid, 300.0)
        epoch = torch.zeros(1, dtype=torch.int64, device=device)
        step_errors = torch.zeros(1, dtype=torch.int64, device=device)
        mailbox = GpuMailbox(segment, epoch, step_errors, timeout_ns=2_000_000_000)
        generator = torch.Generator().manual_seed(1)
        for num_tokens in num_tokens_list:
            hidden = torch.randn(num_tokens, HIDDEN, generator=generator).to(device)
            ids = torch.stack([torch.randperm(num_experts, generator=generator)[:TOP_K]
                               for _ in range(num_tokens)]).to(torch.int32).to(device)
            weights = torch.rand(num_tokens, TOP_K, generator=generator).to(device)
            share = torch.zeros(num_tokens, HIDDEN, device=device)  # [T, D]
            routed = torch.zeros(num_tokens, HIDDEN, device=device)  # [T, D]

            def step() -> None:
                advance_epoch(epoch)
                for layer in range(args.layers):
                    mailbox.post(layer, hidden, ids, weights)
                    mailbox.wait(layer)
                    routed.add_(mailbox.combine_into(share, num_tokens))

            step()
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            steps = args.steps if mode == "echo" else max(2, args.steps // 4)
            for _ in range(args.warmup):
                graph.replay()
            torch.cuda.synchronize(device)
            served0, busy0 = segment.word(Word.SERVED), segment.word(Word.BUSY_NS)
            step_ms = [seconds * 1e3 for seconds in time_s(graph.replay, device, repeats=steps)]
            if segment.word(Word.WAIT_ERROR) != 0 or int(step_errors.item()) != 0:
                raise RuntimeError(f"the GPU waiting side recorded error {segment.word(Word.WAIT_ERROR)} "
                                   f"at seq {segment.word(Word.WAIT_ERROR_SEQ)}")
            served = segment.word(Word.SERVED) - served0
            worker_us = (segment.word(Word.BUSY_NS) - busy0) / max(served, 1) / 1e3
            layer_us = median(step_ms) * 1e3 / args.layers
            record = {"waiting_side": "gpu", "mode": mode, "wait": wait_name, "T": num_tokens, "layers": args.layers,
                      "steps": steps, "experts_owned": num_experts if mode == "experts" else 0, "inter": args.inter,
                      "worker_threads": args.threads, "layers_served": served, "step_ms": median(step_ms),
                      "step_p90_ms": percentile(step_ms, 0.9), "layer_us": layer_us, "worker_us": worker_us,
                      "hop_us": layer_us - worker_us}
            records.append(record)
            print(f"gpu {mode:8s} {wait_name:8s} T={num_tokens:3d}: layer {layer_us:8.1f} us, worker {worker_us:8.1f}, "
                  f"hop {record['hop_us']:7.1f}, step {record['step_ms']:7.2f} ms (p90 {record['step_p90_ms']:7.2f})",
                  flush=True)
            del graph
    finally:
        _stop_worker(segment, process)
        torch.cuda.synchronize(device)
        unregister_host_segment(segment)
        segment.close()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", default="1,8,64", help="rows per step, comma separated (at most 64)")
    parser.add_argument("--modes", default="echo,experts")
    parser.add_argument("--waits", default="backoff,spin")
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--steps", type=int, default=20, help="measured steps (experts mode: a quarter)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (experts mode: all owned)")
    parser.add_argument("--inter", type=int, default=64, help="expert width I of the experts mode")
    parser.add_argument("--threads", type=int, default=1, help="the worker's kernel threads")
    parser.add_argument("--waiting-side", choices=("cpu", "gpu"), default="cpu",
                        help="who posts and waits: a Python stand-in, or a CUDA graph on cuda:0")
    parser.add_argument("--worker-cpu", type=int, default=None, help="pin the worker's thread to this core")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    num_tokens_list = [int(t) for t in args.T.split(",") if t]
    library = load_mailbox()
    load_before = os.getloadavg()
    records = []
    for mode in args.modes.split(","):
        for wait_name in args.waits.split(","):
            run = run_gpu_case if args.waiting_side == "gpu" else run_case
            records += run(library, mode, wait_name, num_tokens_list, args)
    # the hop's share of a layer: the round trip (CPU waiting side) or the whole layer (GPU waiting side)
    ratios = {f"{r['mode']}/{r['wait']}/T{r['T']}/hop_share": r["hop_us"] / r.get("round_trip_us", r["layer_us"])
              for r in records if r.get("round_trip_us", r["layer_us"]) > 0}
    raw = {"hidden": HIDDEN, "top_k": TOP_K, "t_max": T_MAX, "cpu_count": os.cpu_count(),
           "load_average_1_5_15_before": load_before, "load_average_1_5_15_after": os.getloadavg(), "records": records}
    raw["waiting_side"] = args.waiting_side
    path = write_result("cpu-mailbox", raw, ratios, out_dir=args.out_dir,
                        tag="cpu" if args.waiting_side == "cpu" else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
