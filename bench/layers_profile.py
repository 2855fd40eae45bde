"""Where a decode step's device time goes: torch.profiler over eager decode steps of `bench.layers`' stack.

Usage: python -m bench.layers_profile [--layers csa,hca] [--batch 1] [--context 4096] [--steps 3]
Prints the kernels by total device time and the number of kernel launches per step (a CUDA graph
removes host gaps, not the ~2-3 us each small kernel costs on the device).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import layers_timing as timing
    from common.model.random_init import LAYER_KIND_NAMES, flash_config, random_model

    parser = argparse.ArgumentParser(prog="python -m bench.layers_profile")
    parser.add_argument("--layers", default="csa,hca")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda:0")
    config = flash_config([LAYER_KIND_NAMES[k] for k in args.layers.split(",")])
    side, experts = random_model(config, device)
    states = timing.decode_states(config, args.batch, args.context, torch.bfloat16, device, 0)
    timing.time_decode(side, experts, states, config.vocab_size, num_steps=1, use_graphs=False)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timing.time_decode(side, experts, states, config.vocab_size, num_steps=args.steps - 1, use_graphs=False)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    print(f"steps {args.steps} (incl. 1 warm-up), batch {args.batch}: {launches / args.steps:.0f} kernels/step, "
          f"{total_us / args.steps:.0f} us device time/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / args.steps:9.1f} us/step {e.count / args.steps:7.1f}x  {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
