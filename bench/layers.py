"""`moemesh bench layers`: N DeepSeek-V4 layers at true V4-Flash width, weights quantized on the device.

Usage: python -m moemesh.bench.layers [--layers csa,hca] [--batch 1,8,64] [--context 4096] [--prefill 2048,8192]
       [--device cuda:0] [--steps 10] [--no-transformers] [--tiny | --checkpoint DIR] [--out-dir DIR]
       [--disaggregated [--data-planes zmq,cuda_ipc] [--micro-batches 2] [--no-in-process]]

Builds the layers (window / CSA / HCA, learned routers) plus embedding and head with random weights
in the checkpoint formats directly on the device (`common.model.random_init`: FP8 128x128 linears,
FP4 routed experts, bf16 elsewhere; no checkpoint, no dequantised copy), or with `--checkpoint` reads
every layer of a checkpoint directory through the serving workers' loaders (`layers_checkpoint`), and
measures in one run:
the device's copy bandwidth and bf16 matmul rate; per batch size the decode step time, per layer,
with a `--context`-token history already in every sequence's state (written directly as random
rows through the state's append methods, not by a prefill: a 64 x 4K prefill would dominate the
run); prefill time of one `--prefill`-token prompt in one forward; the bytes each step must read
and FLOPs each prefill must do, their floors and the ratio of every figure to its floor; where
transformers is installed, transformers' decode on the same stack; the extrapolation to the
43-layer model. Decode runs in CUDA graphs (see `bench.layers_timing`). With `--disaggregated`
the same stack also runs with the routed experts in an expert worker process on the same device
(`bench.layers_disagg`: the real ModelRunner / MoEDispatcher / ExpertWorker, ZeroMQ and CUDA IPC
data planes, 1 and `--micro-batches` micro-batches), and each disaggregated step is compared with
the in-process steps of the same run. Prints a table and writes bench/results/layers-*.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

GOALS = {"decode_b1_max_ratio": 1.5, "decode_b64_max_ratio": 1.3, "prefill_8k_min_fraction_of_bf16": 0.5,
         "single_stream_min_tok_s": 250.0, "prefill_min_tok_s": 15000.0, "decode_b1_max_kernels_per_layer": 20,
         "disaggregated_max_ratio": {1: 2.0, 8: 1.3, 64: 1.15}}


@contextlib.contextmanager
def _env(name: str, value: str):
    """Set one environment variable for the block (the expert path is read per call)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="moemesh bench layers", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="csa,hca", help="comma list of window, csa, hca")
    parser.add_argument("--batch", type=_int_list, default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=4096, help="tokens already in each sequence at decode")
    parser.add_argument("--prefill", type=_int_list, default=[2048, 8192], help="prompt lengths")
    parser.add_argument("--device", default=None, help="torch device (default cuda:0 if available, else cpu)")
    parser.add_argument("--steps", type=int, default=10, help="timed repetitions (median), >= 10 on CUDA")
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--prefill-expert-paths", type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
                        default=None, help="routed-expert paths timed at prefill: fused, dequant, auto "
                        "(common/kernels/fp4_prefill.py; default: the module's default only)")
    parser.add_argument("--prefill-fp8-paths", type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
                        default=None, help="FP8-linear paths timed at prefill: kernel, dequant, auto "
                        "(common/kernels/fp8_dequant.py; default: the module's default only); every combination "
                        "with --prefill-expert-paths is timed")
    parser.add_argument("--graph-steps", type=int, default=4, help="consecutive decode steps captured")
    parser.add_argument("--no-graphs", action="store_true", help="time decode eagerly")
    parser.add_argument("--no-kernel-profile", action="store_true",
                        help="skip counting each decode piece's kernels with torch.profiler (graphs only)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same structure (CPU checks)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="time every main layer of this checkpoint, read by the serving loaders "
                        "(bench/layers_checkpoint.py) instead of random layers built in memory; --layers and "
                        "--tiny do not apply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disaggregated", action="store_true",
                        help="also run decode with the experts in an expert worker process on the same device")
    parser.add_argument("--data-planes", type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
                        default=["zmq", "cuda_ipc"], help="disaggregated data planes: zmq, cuda_ipc")
    parser.add_argument("--micro-batches", type=int, default=2, help="disaggregated ping-pong micro-batches")
    parser.add_argument("--graph-segments", action="store_true",
                        help="disaggregated: also time with CUDA graphs of the segments between dispatches")
    parser.add_argument("--expert-device", default=None,
                        help="disaggregated: the expert worker's device (default: the attention device)")
    parser.add_argument("--expert-graph-buckets", type=_int_list, default=[],
                        help="disaggregated: token buckets of the expert worker's CUDA graphs (empty: eager)")
    parser.add_argument("--no-in-process", action="store_true",
                        help="skip the in-process CUDA-graph decode, prefill and transformers (disaggregated only)")
    parser.add_argument("--out-dir", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    from moemesh.bench import layers_floors as floors
    from moemesh.bench import layers_timing as timing
    from moemesh.bench.layers_hf import bench_transformers, transformers_available
    from moemesh.bench.layers_report import print_table, summarize
    from moemesh.bench.results_io import write_result
    from moemesh.common.model.random_init import LAYER_KIND_NAMES, flash_config, random_model, tiny_flash_like_config

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"ceilings on {device} ...", flush=True)
    ceilings = timing.measure_ceilings(device)
    if args.checkpoint is not None:
        from moemesh.bench.layers_checkpoint import load_checkpoint_layers

        print(f"loading every layer of {args.checkpoint} ...", flush=True)
        config, side, experts = load_checkpoint_layers(args.checkpoint, device, dtype)
        kinds = list(config.layer_types[:config.num_hidden_layers])
    else:
        kinds = [LAYER_KIND_NAMES[name.strip()] for name in args.layers.split(",") if name.strip()]
        config = tiny_flash_like_config(kinds) if args.tiny else flash_config(kinds)
        print(f"building {len(kinds)} layers ({args.layers}){' tiny' if args.tiny else ''} ...", flush=True)
        side, experts = random_model(config, device, seed=args.seed)
    bytes_info = {
        "layer_weight_bytes": [floors.layer_weight_bytes(side, i) for i in range(len(kinds))],
        "expert_bytes": experts.bytes_per_expert(0),
        "head_weight_bytes": floors.head_weight_bytes(side),
    }
    raw: dict = {"config": {"layers": [k.name.lower() for k in kinds], "tiny": args.tiny,
                            "checkpoint": str(args.checkpoint) if args.checkpoint is not None else None,
                            "hidden_size": config.hidden_size, "n_routed_experts": config.n_routed_experts,
                            "dtype": str(dtype).removeprefix("torch.")},
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "ceilings": ceilings, "bytes": bytes_info,
                 "context_fill": "random rows written through the state stores' append methods (no prefill)",
                 "decode": [], "prefill": []}

    for batch_size in [] if args.no_in_process else args.batch:
        print(f"decode batch {batch_size} ...", flush=True)
        states = timing.decode_states(config, batch_size, args.context, dtype, device, args.seed)
        graph_error = None
        try:
            timed = timing.time_decode(side, experts, states, config.vocab_size, num_steps=args.steps,
                                       num_graph_steps=args.graph_steps, use_graphs=not args.no_graphs,
                                       profile_kernels=not args.no_kernel_profile)
        except RuntimeError as error:  # a capture failure must not lose the rest of the run
            graph_error = f"{type(error).__name__}: {error}"[:2000]
            print(f"  CUDA graph timing failed, timing eagerly: {graph_error[:300]}", flush=True)
            del states
            states = timing.decode_states(config, batch_size, args.context, dtype, device, args.seed)
            timed = timing.time_decode(side, experts, states, config.vocab_size, num_steps=args.steps,
                                       use_graphs=False)
        distinct = timed.distinct_experts  # per layer, counted in the timed steps
        raw["decode"].append({"batch_size": batch_size, "context_tokens": args.context,
                              "piece_s": timed.piece_s, "step_s": timed.step_s, "eager_step_s": timed.eager_step_s,
                              "graphs": device.type == "cuda" and not args.no_graphs and graph_error is None,
                              "graph_error": graph_error, "kernels_per_piece": timed.kernels,
                              "kv_bytes_per_layer": [batch_size * floors.kv_bytes_per_sequence(
                                  config, i, args.context, torch.finfo(dtype).bits // 8) for i in range(len(kinds))],
                              "expected_distinct_experts": floors.expected_distinct_experts(config, batch_size),
                              "distinct_experts_per_layer": distinct,
                              "kernel_read_bytes_per_layer": floors.kernel_read_bytes_per_layer(
                                  side, config, batch_size, args.context, torch.finfo(dtype).bits // 8,
                                  experts.bytes_per_expert(0), distinct)})
        del states
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.disaggregated:
        from moemesh.bench.layers_disagg import run_disaggregated

        print(f"disaggregated decode ({','.join(args.data_planes)}) ...", flush=True)
        try:
            raw["disaggregated"] = run_disaggregated(args, side, experts, config, device, dtype)
        except Exception as error:  # the expert process or a data plane failed: keep the in-process figures
            raw["disaggregated"] = {"error": f"{type(error).__name__}: {error}"[:2000], "runs": []}
            print(f"  disaggregated run failed: {raw['disaggregated']['error'][:500]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    from moemesh.common.kernels import fp8_dequant
    from moemesh.common.kernels.fp4_prefill import DEFAULT_PREFILL_PATH, PREFILL_PATH_ENV

    expert_paths = args.prefill_expert_paths or [DEFAULT_PREFILL_PATH.value]
    fp8_paths = args.prefill_fp8_paths or [fp8_dequant.fp8_prefill_path().value]
    prefill_runs = [(path, fp8_path, n) for path in expert_paths for fp8_path in fp8_paths
                    for n in ([] if args.no_in_process else args.prefill)]
    for expert_path, fp8_path, num_tokens in prefill_runs:
        print(f"prefill {num_tokens} (experts: {expert_path}, fp8 linears: {fp8_path}) ...", flush=True)
        try:
            with _env(PREFILL_PATH_ENV, expert_path), _env(fp8_dequant.PATH_ENV, fp8_path):
                timed = timing.time_prefill(side, experts, config, num_tokens, num_reps=args.prefill_reps,
                                            seed=args.seed)
        except RuntimeError as error:  # out of memory at long prompts: record it, keep the run
            raw.setdefault("prefill_errors", {})[str(num_tokens)] = f"{type(error).__name__}: {error}"[:2000]
            print(f"  prefill {num_tokens} failed: {str(error)[:300]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        raw["prefill"].append({"num_tokens": num_tokens, "expert_path": expert_path, "fp8_path": fp8_path,
                               "attention_path": timed.attention_path,
                               "piece_s": timed.piece_s, "step_s": timed.step_s,
                               "layer_flops": [floors.prefill_layer_flops(config, i, num_tokens)
                                               for i in range(len(kinds))],
                               "head_flops": 2.0 * config.vocab_size * config.hidden_size})
        if device.type == "cuda":
            torch.cuda.empty_cache()

    del side, experts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_transformers and not args.no_in_process and transformers_available():
        print("transformers ...", flush=True)
        raw["transformers"] = bench_transformers(config, args.batch, args.context, args.steps, device, dtype)
    else:
        raw["transformers"] = {"skipped": "--no-transformers" if args.no_transformers else "not installed"}

    ratios = summarize(raw, config, kinds, GOALS)
    path = write_result("layers", raw, ratios, out_dir=args.out_dir)
    print_table(raw, ratios)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
