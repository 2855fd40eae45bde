"""Cost of a staged ZeroMQ send on this host: pipelined throughput and ping-pong latency.

A Dispatch-shaped message (`hidden` [T, D] f32 of the given size, then expert_ids and weights
[T, 6], so the last frames are small as on the real data plane) is sent with
`common.wire.staging.send_staged` from a pool of 4 buffers over ipc:// to a receiver thread that
decodes it and reads every byte of `hidden` (a sum). Two timings per size:
- `stream`: the sender sends N messages back to back (bounded by the pool: a buffer returns when
  libzmq let go of it), the receiver consumes them; time per message.
- `pingpong`: one message at a time, the receiver answers with an 8-byte frame; time per round trip.
The receiver's checksum is compared with the sender's, so a reused-while-queued buffer shows up
as `num_corrupt` instead of a fast number.

Variants (`--variants`, alternated run by run so that load on the host hits both alike):
- `fixed`: `send_staged` as it is (every zero-copy frame tracked, common/wire/tracked_send.py);
- `last_tracker`: the pre-fix send, kept here only as the baseline of the cost: one
  `send_multipart(copy=False, track=True)` whose returned tracker (the last frame's) releases the
  buffer -- too early when the last frame is small.

    python -m moemesh.bench.wire_staging                      # 8 KB, 1 MB, 16 MB, both variants
    python -m moemesh.bench.wire_staging --sizes 8K,1M --repeats 5 --variants fixed --out-dir bench/results
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from moemesh.bench.timing import median

NUM_TOP_K = 6  # K
NUM_BUFFERS = 4
DEFAULT_SIZES = ("8K", "1M", "16M")
_UNITS = {"K": 1 << 10, "M": 1 << 20}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    if text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _message(num_bytes: int, seed: int) -> Any:
    import torch

    from moemesh.common.wire.messages import Dispatch

    hidden_size = 256  # D
    num_tokens = max(1, num_bytes // (4 * hidden_size))  # T
    generator = torch.Generator().manual_seed(seed)
    return Dispatch(dispatch_id=seed, step_id=0, layer=0, micro_batch=0,
                    hidden=torch.randn(num_tokens, hidden_size, generator=generator),  # [T, D] f32
                    expert_ids=torch.zeros(num_tokens, NUM_TOP_K, dtype=torch.int32),  # [T, K]
                    weights=torch.rand(num_tokens, NUM_TOP_K, generator=generator))  # [T, K] f32


def _receiver(context: Any, address: str, num_messages: int, answer: bool, sums: list[float]) -> None:
    import zmq

    from moemesh.common.wire import codec

    socket = context.socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    for _ in range(num_messages):
        if not socket.poll(30_000, zmq.POLLIN):
            break
        message = codec.decode(socket.recv_multipart(copy=False))
        sums.append(float(message.hidden.double().sum()))
        if answer:
            socket.send(b"\0" * 8)
    socket.close(0)


def _send_last_tracker(socket: Any, pool: Any, frames_for: Any) -> None:
    """The pre-fix staged send (baseline only): releases the buffer on the LAST frame's tracker."""
    lease = pool.acquire()
    try:
        frames = frames_for(lease.write)
        lease.seal()
        tracker = socket.send_multipart(frames, copy=False, track=True)
    except BaseException:
        lease.release_after(None)
        raise
    lease.release_after(tracker)


def run_case(num_bytes: int, num_messages: int, pingpong: bool, variant: str) -> dict[str, Any]:
    import zmq

    from moemesh.common.wire import codec
    from moemesh.common.wire.staging import SendStagingPool, StagingConfig, send_staged

    send = send_staged if variant == "fixed" else _send_last_tracker

    messages = [_message(num_bytes, seed) for seed in range(4)]
    expected = [float(message.hidden.double().sum()) for message in messages]
    pool = SendStagingPool(StagingConfig(num_buffers=NUM_BUFFERS, buffer_bytes=num_bytes * 5 // 4 + (1 << 16),
                                         max_wait_s=30.0, pin_memory=False))
    context = zmq.Context()
    with tempfile.TemporaryDirectory() as directory:
        address = f"ipc://{directory}/bench.sock"
        sender = context.socket(zmq.PAIR)
        sender.setsockopt(zmq.LINGER, 0)
        sender.bind(address)
        sums: list[float] = []
        receiver = threading.Thread(target=_receiver, args=(context, address, num_messages, pingpong, sums))
        receiver.start()
        started = time.perf_counter()
        for index in range(num_messages):
            message = messages[index % len(messages)]
            send(sender, pool, lambda writer, message=message: codec.encode(message, tensor_writer=writer))
            if pingpong and not sender.poll(30_000, zmq.POLLIN):
                break
            if pingpong:
                sender.recv()
        receiver.join(60)
        elapsed_s = time.perf_counter() - started
        sender.close(0)
    context.term()
    num_corrupt = sum(got != expected[index % len(messages)] for index, got in enumerate(sums))
    return {"variant": variant, "num_bytes": num_bytes, "mode": "pingpong" if pingpong else "stream",
            "num_messages": num_messages, "num_received": len(sums), "num_corrupt": num_corrupt,
            "us_per_message": 1e6 * elapsed_s / num_messages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help="hidden bytes per message, e.g. 8K,1M,16M")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case and variant; the median is reported")
    parser.add_argument("--variants", default="fixed,last_tracker", help="fixed, last_tracker (the pre-fix baseline)")
    parser.add_argument("--out-dir", default=None, help="write a JSON result there (bench.results_io)")
    args = parser.parse_args(argv)
    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    if not variants or any(name not in ("fixed", "last_tracker") for name in variants):
        parser.error("--variants takes fixed and/or last_tracker")
    rows = []
    for size_text in args.sizes.split(","):
        num_bytes = parse_size(size_text)
        num_messages = max(20, min(2000, (64 << 20) // num_bytes))
        for pingpong in (False, True):
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name in variants:
                    runs[name].append(run_case(num_bytes, num_messages, pingpong, name))
            for name in variants:
                row = dict(runs[name][0])
                row["us_per_message"] = median([run["us_per_message"] for run in runs[name]])
                row["us_per_message_runs"] = [round(run["us_per_message"], 1) for run in runs[name]]
                row["num_corrupt"] = sum(run["num_corrupt"] for run in runs[name])
                rows.append(row)
                print(f"{size_text:>5} {row['mode']:>8} {name:>12}: {row['us_per_message']:9.1f} us/message "
                      f"(runs {row['us_per_message_runs']}), "
                      f"corrupt {row['num_corrupt']}/{num_messages * args.repeats}", flush=True)
    if args.out_dir:
        from moemesh.bench import results_io

        results_io.write_result("wire-staging", {"rows": rows}, out_dir=Path(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
