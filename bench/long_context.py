"""`moemesh bench long-context`: long prompts through a running server, against their floors.

Usage: moemesh bench long-context --base-url URL --model-dir DIR [--lengths 65536,131072] [--decode-tokens 32]
       [--probes 5] [--load-probes 12] [--log-dir DIR] [--ceilings-device cuda:0] [--kv-dtype fp8|bf16]
       [--warm-up-length N] [--label TEXT] [--seed TEXT] [--out-dir DIR]

Against a server started with `moemesh serve` (idle, prefix caching harmless: every prompt is random token ids
drawn from the run's `--seed`, fresh unless given), in order:
1. capacity: `/status.json` (the router's KV blocks per tier, block size, max_model_len) in tokens, and how many
   sequences of 128K and of 1M tokens fit at once; with `--log-dir` also the attention worker's
   `attention.kv_capacity` event (bytes per block, per context token, per layer type);
2. warm-up (kept in the JSON as `warm_up`, out of the figures): two short requests, then one request of
   `--warm-up-length` prompt tokens (default the longest length; 0 skips it) with `--load-probes` short ones
   arriving together during its prefill, so the kernel compiles and graph captures that a first long prefill,
   a mixed prefill/decode step and decode at that context trigger (tens of seconds on a fresh machine) land
   before anything is measured;
3. idle TTFT: `--probes` short requests (64 prompt tokens, 2 output tokens) one after another;
4. per `--lengths` L: one streamed request of L prompt tokens and `--decode-tokens` output tokens (ignore_eos,
   temperature 0): prefill tok/s = L / TTFT, decode per step = (last token - first token) / (tokens - 1), the
   context then being L..L+decode_tokens;
5. TTFT under load: the longest length again, and `--load-probes` short requests arriving open-loop at moments
   drawn uniformly over that prefill (its duration from step 4, counted from when the server reports it
   running): their median TTFT over the idle median. Open-loop, because a probe sent when the previous one
   answers lands on the same point of the server's step cycle every time.

Floors (`bench.layers_floors`, the model's config): prefill FLOPs of every layer at L tokens (matmuls, the
attention core over window, CSA top-k and HCA rows, the CSA indexer) over the device's bf16 matmul rate; a decode
step's bytes (the attention-side weights but the embedding, `num_experts_per_tok` routed experts per layer as
stored, the head, and the KV rows one step reads at the context, in the `--kv-dtype` layout) over its copy
bandwidth. The rates are measured here (`--ceilings-device`, the server's device: the client then runs on the
same host, between requests). Writes bench/results/long-context-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from moemesh.bench.serve_client import Endpoint, send_request
from moemesh.bench.timing import median

SHORT_PROMPT_TOKENS = 64
WARM_UP_PROBE_SPAN_S = 1.0  # the warm-up's short requests arrive together: decode steps of several sizes
REFERENCE_LENGTHS = (131072, 1048576)  # the sequence lengths capacity is reported for
# stored bytes per stored element of a KV row: bf16 2; fp8 the 584-byte row of 512 channels, the 132-byte
# indexer row of 128 (docs/model.md §3.1)
KV_ELEMENT_BYTES = {"bf16": (2.0, 2.0), "fp8": (584 / 512, 132 / 128)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moemesh bench long-context", description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model-dir", required=True, help="the checkpoint the server runs (its config.json)")
    parser.add_argument("--lengths", default="65536,131072", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--decode-tokens", type=int, default=32, help="output tokens of each long request")
    parser.add_argument("--probes", type=int, default=5, help="short requests for the idle TTFT")
    parser.add_argument("--load-probes", type=int, default=12,
                        help="short requests arriving at random moments during the longest prefill")
    parser.add_argument("--log-dir", default=None, help="the services' logs (for the attention.kv_capacity event)")
    parser.add_argument("--ceilings-device", default=None,
                        help="measure copy bandwidth and bf16 matmul rate on this device for the floors")
    parser.add_argument("--kv-dtype", choices=tuple(KV_ELEMENT_BYTES), default="bf16",
                        help="how the server stores KV rows (the decode floor's KV bytes)")
    parser.add_argument("--label", default=None, help="the device description written into the result")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    parser.add_argument("--warm-up-length", type=int, default=None, metavar="N",
                        help="prompt tokens of the long warm-up request (default: the longest --lengths; 0: none)")
    parser.add_argument("--seed", default=None,
                        help="prompts are drawn from it (default: a fresh one each run, so a rerun against the same "
                             "server misses its prefix cache)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = f"{random.SystemRandom().getrandbits(48):012x}"
    args.lengths = [int(part) for part in args.lengths.split(",") if part.strip()]
    if not args.lengths or min(args.lengths) < SHORT_PROMPT_TOKENS or args.decode_tokens < 2 or args.probes < 1 \
            or args.load_probes < 1:
        parser.error("--lengths must be >= 64 tokens each, --decode-tokens >= 2, --probes and --load-probes >= 1")
    return args


# ------------------------------------------------------------------ floors


def prefill_floor_s(config, num_tokens: int, flops_per_s: float) -> float:
    from moemesh.bench.layers_floors import prefill_layer_flops

    flops = sum(prefill_layer_flops(config, layer, num_tokens) for layer in range(config.num_hidden_layers))
    return flops / flops_per_s


def decode_step_bytes(config, context_tokens: int, kv_dtype: str) -> dict:
    """Bytes one single-sequence decode step at `context_tokens` must read: weights and KV rows."""
    from moemesh.bench.layers_floors import kv_bytes_per_sequence
    from moemesh.common.model.inventory import tensor_inventory
    from moemesh.common.placement.worker_budget import _tensor_bytes, resident_bytes_per_expert

    inventory = tensor_inventory(config)
    weights = sum(_tensor_bytes(spec, 2) for name, spec in inventory.items()
                  if spec.is_attention_side and name != "embed.weight")
    experts = config.num_hidden_layers * config.num_experts_per_tok * resident_bytes_per_expert(config)
    main_bytes, index_bytes = KV_ELEMENT_BYTES[kv_dtype]
    kv = 0.0
    for layer in range(config.num_hidden_layers):
        # main rows at main_bytes per element; the indexer rows' share re-priced at index_bytes
        all_main = kv_bytes_per_sequence(config, layer, context_tokens, 1)
        index_elements = 0
        if config.layer_types[layer].name == "CSA":
            index_elements = (context_tokens + 1) // config.csa_compress_ratio * config.index_head_dim
        kv += (all_main - index_elements) * main_bytes + index_elements * index_bytes
    return {"weight_bytes": weights, "routed_expert_bytes": experts, "kv_bytes": int(kv),
            "total_bytes": int(weights + experts + kv)}


def measure_rates(device_name: str) -> dict:
    import torch

    from moemesh.bench.layers_timing import measure_ceilings

    return measure_ceilings(torch.device(device_name))


# ------------------------------------------------------------------ requests


def random_prompt(num_tokens: int, vocab_size: int, seed: str) -> list[int]:
    """Token ids away from both ends of the vocabulary (special and control tokens)."""
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 8), vocab_size - min(1000, vocab_size // 8)
    return [rng.randrange(low, high) for _ in range(num_tokens)]


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def summarise(record, num_prompt_tokens: int) -> dict:
    if record.error is not None:
        return {"prompt_tokens": num_prompt_tokens, "error": record.error}
    tokens = record.num_output_tokens or 0
    decode_s = record.chunk_times_s[-1] - record.chunk_times_s[0] if len(record.chunk_times_s) > 1 else None
    # with one event per token, decode steps = output tokens - 1
    per_step = decode_s / (tokens - 1) if decode_s is not None and tokens > 1 else None
    return {"prompt_tokens": num_prompt_tokens, "reported_prompt_tokens": record.num_prompt_tokens,
            "output_tokens": tokens, "ttft_s": record.ttft_s, "e2e_s": record.e2el_s,
            "decode_step_s": per_step, "prefill_tokens_per_s": num_prompt_tokens / record.ttft_s}


async def status(client: httpx.AsyncClient) -> dict:
    response = await client.get("/status.json")
    response.raise_for_status()
    return response.json()


async def short_ttfts(client, model: str, vocab: int, count: int, seed: str) -> list[float]:
    """TTFT of `count` short requests sent one after another."""
    ttfts = []
    for index in range(count):
        body = request_body(model, random_prompt(SHORT_PROMPT_TOKENS, vocab, f"{seed}/{index}"), 2)
        record = await send_request(client, index, Endpoint.COMPLETIONS, body)
        if record.error is not None:
            raise RuntimeError(f"short request failed: {record.error}")
        ttfts.append(record.ttft_s)
    return ttfts


async def ttft_under_prefill(client, model: str, vocab: int, length: int, decode_tokens: int, seed: str,
                             num_probes: int, expected_prefill_s: float) -> dict:
    """The long request, and `num_probes` short ones arriving open-loop at random moments while it prefills: each
    is sent at an offset drawn uniformly from the first 90 % of `expected_prefill_s` after the router runs the long
    one (tokenizing and admission are not prefill), none waits for another, so arrivals fall anywhere in the
    server's steps as a user's would. Probes sent before the long request's first token count."""
    first_token = asyncio.Event()
    long_task = asyncio.create_task(send_request(
        client, 0, Endpoint.COMPLETIONS, request_body(model, random_prompt(length, vocab, seed), decode_tokens),
        on_first_token=first_token.set))
    started = time.perf_counter()
    while not long_task.done() and (await status(client)).get("engine", {}).get("num_running", 0) < 1:
        await asyncio.sleep(0.05)
    running_at = time.perf_counter()
    rng = random.Random(seed)
    offsets_s = sorted(rng.uniform(0.0, 0.9 * expected_prefill_s) for _ in range(num_probes))

    async def probe(index: int, offset_s: float) -> dict | None:
        await asyncio.sleep(max(0.0, running_at + offset_s - time.perf_counter()))
        if first_token.is_set() or long_task.done():
            return None
        sent_s = time.perf_counter() - running_at
        body = request_body(model, random_prompt(SHORT_PROMPT_TOKENS, vocab, f"{seed}/probe/{index}"), 2)
        record = await send_request(client, index + 1, Endpoint.COMPLETIONS, body)
        if record.error is not None:
            raise RuntimeError(f"short request failed: {record.error}")
        return {"sent_after_running_s": sent_s, "ttft_s": record.ttft_s}

    probes = [p for p in await asyncio.gather(*(probe(i, o) for i, o in enumerate(offsets_s))) if p is not None]
    record = await long_task
    return {"long": summarise(record, length), "running_after_s": running_at - started,
            "expected_prefill_s": expected_prefill_s, "probes": probes,
            "probe_ttfts_s": [p["ttft_s"] for p in probes]}


def capacity(engine: dict, kv_event: dict | None) -> dict:
    block = int(engine["kv_block_size_tokens"])
    gpu_blocks, cpu_blocks = int(engine["kv_blocks_total"]["gpu"]), int(engine["kv_blocks_total"]["cpu"])
    fits = {str(length): {"device": gpu_blocks // -(-length // block), "device_and_cpu_tier":
                          (gpu_blocks + cpu_blocks) // -(-length // block)} for length in REFERENCE_LENGTHS}
    return {"block_size_tokens": block, "device_tokens": gpu_blocks * block, "cpu_tier_tokens": cpu_blocks * block,
            "max_model_len": engine.get("max_model_len"), "sequences_that_fit": fits, "attention_event": kv_event}


def read_kv_event(log_dir: str | None) -> dict | None:
    if log_dir is None:
        return None
    for path in sorted(Path(log_dir).glob("*.log")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if '"attention.kv_capacity"' in line:
                try:
                    return json.loads(line)
                except ValueError:
                    continue
    return None


async def run(args: argparse.Namespace, config) -> dict:
    vocab = config.vocab_size
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        engine = (await status(client))["engine"]
        max_len = int(engine.get("max_model_len") or 0)
        too_long = [length for length in args.lengths if length + args.decode_tokens > max_len]
        if too_long:
            raise SystemExit(f"lengths {too_long} + {args.decode_tokens} output tokens exceed the server's "
                             f"max_model_len {max_len} (serve --kv-tokens / --max-model-len)")
        result = {"seed": args.seed, "capacity": capacity(engine, read_kv_event(args.log_dir))}
        await short_ttfts(client, model, vocab, 2, seed=f"{args.seed}/warm-up")  # first-request costs: no figure
        warm_up_length = max(args.lengths) if args.warm_up_length is None else args.warm_up_length
        if warm_up_length:
            warm = await ttft_under_prefill(client, model, vocab, warm_up_length, args.decode_tokens,
                                            seed=f"{args.seed}/warm-up-long", num_probes=args.load_probes,
                                            expected_prefill_s=WARM_UP_PROBE_SPAN_S)
            result["warm_up"] = {"long": warm["long"], "probe_ttfts_s": warm["probe_ttfts_s"]}
            print(json.dumps({"warm_up": result["warm_up"]}), flush=True)
        idle = await short_ttfts(client, model, vocab, args.probes, seed=f"{args.seed}/idle")
        result["idle_ttft_s"] = idle
        runs = []
        for index, length in enumerate(args.lengths):
            prompt = random_prompt(length, vocab, seed=f"{args.seed}/long/{index}")
            body = request_body(model, prompt, args.decode_tokens)
            record = await send_request(client, index, Endpoint.COMPLETIONS, body)
            runs.append(summarise(record, length))
            print(json.dumps(runs[-1]), flush=True)
        result["long_requests"] = runs
        longest = max(args.lengths)
        measured = [run["ttft_s"] for run in runs if run["prompt_tokens"] == longest and "error" not in run]
        if not measured:
            raise SystemExit(f"the {longest}-token request failed: no prefill time to place the load probes in")
        under = await ttft_under_prefill(client, model, vocab, longest, args.decode_tokens,
                                         seed=f"{args.seed}/under-load",
                                         num_probes=args.load_probes, expected_prefill_s=measured[0])
        result["under_prefill"] = under
        after = (await status(client))["engine"]
        result["preemptions"] = after.get("preemptions")
        return result


def ratios_and_floors(result: dict, config, rates: dict | None, kv_dtype: str) -> dict:
    ratios = {}
    idle = median(result["idle_ttft_s"])
    probes = result["under_prefill"]["probe_ttfts_s"]
    if probes:
        ratios["short_ttft_under_prefill_over_idle"] = median(probes) / idle
    for run in result["long_requests"]:
        if "error" in run:
            continue
        length = run["prompt_tokens"]
        run["decode_floor"] = decode_step_bytes(config, length + 1, kv_dtype)
        if rates is None:
            continue
        floor_prefill = prefill_floor_s(config, length, rates["bf16_flops_per_s"])
        run["prefill_floor_s"] = floor_prefill
        ratios[f"prefill_fraction_of_bf16_floor/{length}"] = floor_prefill / run["ttft_s"]
        floor_step = run["decode_floor"]["total_bytes"] / rates["copy_bytes_per_s"]
        run["decode_floor_step_s"] = floor_step
        if run["decode_step_s"]:
            ratios[f"decode_step_over_floor/{length}"] = run["decode_step_s"] / floor_step
    return ratios


def main(argv: list[str] | None = None) -> int:
    from moemesh.bench.results_io import write_result
    from moemesh.common.model.config import ModelConfig

    args = parse_args(argv)
    config = ModelConfig.load(args.model_dir)
    result = asyncio.run(run(args, config))
    rates = measure_rates(args.ceilings_device) if args.ceilings_device else None
    result["rates"] = rates
    result["model"] = {"path": args.model_dir, "num_hidden_layers": config.num_hidden_layers,
                       "hidden_size": config.hidden_size, "kv_dtype": args.kv_dtype}
    ratios = ratios_and_floors(result, config, rates, args.kv_dtype)
    cap = result["capacity"]
    print(f"KV capacity: {cap['device_tokens']:,} tokens on the device, {cap['cpu_tier_tokens']:,} on the CPU tier; "
          f"max_model_len {cap['max_model_len']:,}; sequences that fit on the device: "
          + ", ".join(f"{k} tokens: {v['device']}" for k, v in cap["sequences_that_fit"].items()))
    print(f"idle TTFT median {median(result['idle_ttft_s']) * 1e3:.1f} ms")
    for run_ in result["long_requests"]:
        if "error" in run_:
            print(f"{run_['prompt_tokens']} tokens: FAILED {run_['error']}")
            continue
        step = run_["decode_step_s"]
        print(f"{run_['prompt_tokens']:>8} tokens: TTFT {run_['ttft_s']:.2f} s, prefill "
              f"{run_['prefill_tokens_per_s']:,.0f} tok/s, decode step "
              + (f"{step * 1e3:.2f} ms" if step else "n/a"))
    under = result["under_prefill"]
    print(f"short TTFT during a {under['long']['prompt_tokens']}-token prefill: "
          f"{len(under['probe_ttfts_s'])} probes, median "
          f"{median(under['probe_ttfts_s']) * 1e3 if under['probe_ttfts_s'] else float('nan'):.1f} ms")
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    out_dir = Path(args.out_dir) if args.out_dir else None
    print(write_result("long-context", result, ratios, device=args.label, out_dir=out_dir))
    failed = [r for r in result["long_requests"] if "error" in r] + (
        [under["long"]] if "error" in under["long"] else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
