"""The measured runs of `bench.fullsize`: decode per (routing, batch), prefill per prompt length.

Each run drives the in-process attention worker through `run_requests`, then asks every expert
worker for its dispatch records and analyses the measured steps (`bench.fullsize_report`). Between
routings only the gate biases change (`apply_routing_skew`, or the generated biases restored), so one
weight generation serves every run. With --tiny every decode run is also compared with the
in-process reference (`bench.fullsize_reference`).
"""

from __future__ import annotations

import time

import torch


def _gate_biases(side, config) -> dict[int, torch.Tensor]:
    from common.model.config import RouterKind

    return {layer: side.layers[layer].ffn.gate.bias.detach().clone() for layer in range(config.num_hidden_layers)
            if config.mlp_layer_types[layer] is not RouterKind.HASH}


def _set_routing(worker, config, routing: str, original: dict[int, torch.Tensor], seed: int, skew: float) -> None:
    from services.attention.random_weights import apply_routing_skew

    for layer, bias in original.items():
        worker.side.layers[layer].ffn.gate.bias.data.copy_(bias)
    if routing == "skewed":
        apply_routing_skew(worker.side, config, seed, skew)
    elif routing != "uniform":
        raise ValueError(f"routing {routing!r} is not uniform or skewed")


def _layer_bytes(side, config) -> tuple[list[int], int, int]:
    from bench.layers_floors import head_weight_bytes, layer_weight_bytes

    layers = [layer_weight_bytes(side, layer) for layer in range(config.num_hidden_layers)]
    embed = side.embed.weight
    return layers, head_weight_bytes(side), embed.shape[1] * embed.element_size()


def run_all(args, worker, cluster, config, bandwidth: dict, model_dir) -> dict:
    from bench.fullsize import _ints
    from bench.fullsize_report import analyse_steps
    from bench.fullsize_setup import FAR_WORKER, NEAR_WORKER
    from bench.fullsize_timing import flush_expert_timings, random_prompts, run_requests

    dispatcher = worker.runner.dispatcher
    endpoints = {name: cluster.endpoint_of(name) for name in cluster.expert_names}
    layer_bytes, head_bytes, embed_row_bytes = _layer_bytes(worker.side, config)
    blocks = worker.config.kv.num_primary_blocks
    common = dict(near_worker=NEAR_WORKER, far_worker=FAR_WORKER, layer_bytes=layer_bytes, head_bytes=head_bytes,
                  embed_row_bytes=embed_row_bytes, near_bw=bandwidth["near_bytes_per_s"],
                  far_bw=bandwidth["far_bytes_per_s"], top_k=config.num_experts_per_tok)
    original = _gate_biases(worker.side, config)
    decode, prefill, checks = [], [], []
    routings = [r for r in args.routing.split(",") if r]
    for routing in routings:
        _set_routing(worker, config, routing, original, args.seed, args.skew)
        for batch in _ints(args.batch):
            prompts = random_prompts(batch, args.context, config.vocab_size, args.seed + batch)
            num_tokens = args.warmup_steps + args.decode_steps + 1  # the first comes from the prefill step
            began_s = time.perf_counter()
            flush_expert_timings(endpoints, cluster.timing_dir)  # drop anything recorded before this run
            dispatcher.records.clear()
            try:
                result = run_requests(worker, prompts, num_tokens, block_size_tokens=128,
                                      num_primary_blocks=blocks, max_batched_tokens=max(2048, batch * args.context),
                                      with_logprobs=args.tiny, prefix=f"{routing}-b{batch}",
                                      on_step=None if args.tiny else _print_step)
            except Exception as error:  # a failed run is recorded; the next one still runs
                if args.tiny:
                    raise
                decode.append({"routing": routing, "batch": batch, "error": f"{type(error).__name__}: {error}"[:2000],
                               "run_wall_s": time.perf_counter() - began_s})
                print(f"{routing} B={batch}: {decode[-1]['error'][:300]}", flush=True)
                _save_partial(args, decode, prefill)
                continue
            timings = flush_expert_timings(endpoints, cluster.timing_dir)
            decode_steps = [s for s in result.steps if s.is_decode][args.warmup_steps:]
            analysis = analyse_steps(decode_steps, dispatcher.records, timings, **common)
            summary = analysis["summary"]
            prefill_steps = [s for s in result.steps if not s.is_decode]
            decode.append({"routing": routing, "batch": batch,
                           "tokens_per_s": batch / summary["step_s"] if summary["step_s"] else None,
                           "floor_tokens_per_s": batch / summary["floor_s"] if summary["floor_s"] else None,
                           "summary": summary, "steps": analysis["steps"],
                           "context_prefill_s": sum(s.wall_s for s in prefill_steps),
                           "run_wall_s": time.perf_counter() - began_s,
                           "far_worker_threads": timings.get(FAR_WORKER, {}).get("num_threads"),
                           "num_empty_selections": {n: t.get("num_empty_selections") for n, t in timings.items()}})
            print(f"{routing} B={batch}: {decode[-1]['tokens_per_s']:.2f} tok/s (floor "
                  f"{decode[-1]['floor_tokens_per_s']:.1f}), near share {summary['near_slot_share']}", flush=True)
            if args.tiny:
                checks.append(_reference_check(model_dir, routing, args, prompts, num_tokens, result, batch))
            _save_partial(args, decode, prefill)
    for num_tokens in _ints(args.prefill):
        routing = routings[-1]
        prompts = random_prompts(1, num_tokens, config.vocab_size, args.seed + num_tokens)
        try:  # twice: the first compiles and tunes kernels for this length; the second is timed
            began_s = time.perf_counter()
            run_requests(worker, prompts, 1, block_size_tokens=128, num_primary_blocks=blocks,
                         max_batched_tokens=num_tokens, prefix=f"prefill-warm-{num_tokens}")
            first_s = time.perf_counter() - began_s
            flush_expert_timings(endpoints, cluster.timing_dir)
            dispatcher.records.clear()
            result = run_requests(worker, prompts, 1, block_size_tokens=128, num_primary_blocks=blocks,
                                  max_batched_tokens=num_tokens, prefix=f"prefill-{num_tokens}")
        except Exception as error:  # out of memory at 8K beside 100 GiB of experts: record, keep the run
            prefill.append({"num_tokens": num_tokens, "routing": routing, "error": f"{type(error).__name__}: {error}"})
            print(f"prefill {num_tokens}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        timings = flush_expert_timings(endpoints, cluster.timing_dir)
        steps = [s for s in result.steps if not s.is_decode]
        analysis = analyse_steps(steps, dispatcher.records, timings, **common)
        step_s = analysis["summary"]["step_s"]
        prefill.append({"num_tokens": num_tokens, "routing": routing, "tokens_per_s": num_tokens / step_s,
                        "summary": analysis["summary"], "num_steps": len(steps), "first_run_s": first_s})
        print(f"prefill {num_tokens}: {step_s:.2f} s, {num_tokens / step_s:.0f} tok/s", flush=True)
        _save_partial(args, decode, prefill)
    out = {"decode": decode, "prefill": prefill}
    if checks:
        out["reference_check"] = {"ok": all(c["tokens_equal"] and c["max_abs_logprob_diff"] <= 1e-4 for c in checks),
                                  "runs": checks}
    return out


def _print_step(step) -> None:
    print(f"  step {step.step_id}: {step.num_sequences} seqs, {step.num_tokens} tokens, "
          f"{'decode' if step.is_decode else 'prefill'} {step.wall_s * 1e3:.0f} ms", flush=True)


def _save_partial(args, decode: list, prefill: list) -> None:
    """The runs so far, in case a wall-clock cap ends the benchmark before its result file."""
    import json

    if args.out_dir is None:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [{k: v for k, v in run.items() if k != "steps"} for run in decode]  # per-step rows left out
    (args.out_dir / "fullsize-partial.json").write_text(json.dumps({"partial": True, "decode": summaries,
                                                                     "prefill": prefill}, indent=1))


def _reference_check(model_dir, routing: str, args, prompts, num_tokens: int, result, batch: int) -> dict:
    from bench.fullsize_reference import build_reference, compare, reference_generate

    model, _config = build_reference(str(model_dir), args.skew if routing == "skewed" else 0.0)
    ref_outputs, ref_logprobs = reference_generate(model, prompts, num_tokens)
    check = compare(result.outputs, result.logprobs, ref_outputs, ref_logprobs, f"{routing}-b{batch}")
    check.update(routing=routing, batch=batch)
    print(f"reference check {routing} B={batch}: {check}", flush=True)
    return check
