"""The measured runs of `bench.fullsize`: decode per (routing, batch), prefill per prompt length.

Each decode run drives the in-process attention worker through `run_requests`: a prefill of
--context tokens per sequence (the context; at most --max-context-tokens / B each when that is set;
one step, or several of 8,192 tokens), --warmup-steps decode steps, then up to
--decode-steps measured decode steps (fewer when --run-budget-s runs out; at least one). Then it
asks every expert worker for its dispatch records and analyses the measured steps
(`bench.fullsize_report`). Between routings only the gate biases change, so one load of the
checkpoint serves every run. With --tiny every decode run is also compared with the in-process reference
(`bench.fullsize_reference`).

Context routing (`--context-routing`):
- natural: the context prefill routes as the decode does (a real prefill; through the CPU experts
  too when they are far, which is slow without the native CPU kernel);
- near: the context prefill touches only the near (GPU) experts, so a long context costs GPU time
  only: the prompts are drawn from the token ids whose hash-layer experts (tid2eid, first layers)
  are all near, and every learned gate gets +`_NEAR_BIAS` on its near experts for that one step.
  The gate biases of the measured routing are set back before the first decode step, so the decode
  routes exactly as in a natural run; the KV cache holds a real (differently routed) context.
Legend: B sequences, L layers, E routed experts, V vocab, K top-k.
"""

from __future__ import annotations

import time

import torch

_NEAR_BIAS = 10.0  # >> the spread of the gate scores: selection picks near experts while the layer has K of them
_MIN_NEAR_TOKENS = 16  # fewer token ids than this route near in every hash layer: use natural routing
_MAX_STEP_TOKENS = 8192  # a longer context (B x --context) is prefilled in several steps


def _gate_biases(side, config) -> dict[int, torch.Tensor]:
    from moemesh.common.model.config import RouterKind

    return {layer: side.layers[layer].ffn.gate.bias.detach().clone() for layer in range(config.num_hidden_layers)
            if config.mlp_layer_types[layer] is not RouterKind.HASH}


def _set_routing(worker, config, routing: str, original: dict[int, torch.Tensor], seed: int, skew: float) -> None:
    """uniform: the checkpoint's own gate biases; skewed: those of a checkpoint written with
    --routing-skew `skew` and the same seed (`bench.random_checkpoint.skew_bias`), learned layers only."""
    from moemesh.bench.random_checkpoint import skew_bias

    if routing not in ("uniform", "skewed"):
        raise ValueError(f"routing {routing!r} is not uniform or skewed")
    for layer, bias in original.items():
        gate_bias = worker.side.layers[layer].ffn.gate.bias
        if routing == "skewed":
            bias = torch.from_numpy(skew_bias(config.n_routed_experts, layer, seed, skew))
        gate_bias.data.copy_(bias.to(gate_bias.device, gate_bias.dtype))


def near_mask(plan, config, device) -> torch.Tensor:
    """[L, E] bool: pairs the plan puts on the near worker."""
    mask = torch.zeros(config.num_hidden_layers, config.n_routed_experts, dtype=torch.bool)
    for layer, expert in plan.placement.workers[0].expert_ids:
        mask[int(layer), int(expert)] = True
    return mask.to(device)


def near_context_tokens(side, config, near: torch.Tensor) -> torch.Tensor:
    """[N] token ids whose experts in every hash layer are all near (all ids when there is no hash layer)."""
    from moemesh.common.model.config import RouterKind

    ok = torch.ones(config.vocab_size, dtype=torch.bool, device=near.device)  # [V]
    for layer in range(config.num_hidden_layers):
        if config.mlp_layer_types[layer] is RouterKind.HASH:
            table = side.layers[layer].ffn.gate.tid2eid.to(near.device)  # [V, K]
            ok &= near[layer][table].all(dim=-1)
    ok[:2] = False  # keep clear of the special ids random_prompts avoids too
    return ok.nonzero().squeeze(1).cpu()


def _route_near(worker, config, near: torch.Tensor, original: dict[int, torch.Tensor]) -> None:
    for layer, bias in original.items():
        gate_bias = worker.side.layers[layer].ffn.gate.bias
        gate_bias.data.copy_(bias + _NEAR_BIAS * near[layer].to(bias.device, bias.dtype))


def _context_prompts(batch: int, num_tokens: int, vocab: torch.Tensor | int, seed: int) -> list[list[int]]:
    from moemesh.bench.fullsize_timing import random_prompts

    if isinstance(vocab, int):
        return random_prompts(batch, num_tokens, vocab, seed)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, vocab.numel(), (batch, num_tokens), generator=generator)
    return vocab[picks].tolist()


def _layer_bytes(side, config) -> tuple[list[int], int, int]:
    from moemesh.bench.layers_floors import head_weight_bytes, layer_weight_bytes

    layers = [layer_weight_bytes(side, layer) for layer in range(config.num_hidden_layers)]
    embed = side.embed.weight
    return layers, head_weight_bytes(side), embed.shape[1] * embed.element_size()


def run_all(args, worker, cluster, config, bandwidth: dict, model_dir, plan=None) -> dict:
    from moemesh.bench.fullsize import _ints
    from moemesh.bench.fullsize_report import analyse_steps
    from moemesh.bench.fullsize_setup import FAR_WORKER, NEAR_WORKER
    from moemesh.bench.fullsize_timing import flush_expert_timings, random_prompts, run_requests

    dispatcher = worker.runner.dispatcher
    endpoints = {name: cluster.endpoint_of(name) for name in cluster.expert_names}
    layer_bytes, head_bytes, embed_row_bytes = _layer_bytes(worker.side, config)
    blocks = worker.config.kv.num_primary_blocks
    common = dict(near_worker=NEAR_WORKER, far_worker=FAR_WORKER, layer_bytes=layer_bytes, head_bytes=head_bytes,
                  embed_row_bytes=embed_row_bytes, near_bw=bandwidth["near_bytes_per_s"],
                  far_bw=bandwidth["far_bytes_per_s"], top_k=config.num_experts_per_tok)
    original = _gate_biases(worker.side, config)
    context = {"routing": args.context_routing, "num_tokens_per_sequence": args.context,
               "max_tokens_per_run": args.max_context_tokens}
    near, context_vocab = None, config.vocab_size
    if args.context_routing == "near" and plan is not None:
        near = near_mask(plan, config, worker.device)
        tokens = near_context_tokens(worker.side, config, near)
        context["num_near_vocab_tokens"] = int(tokens.numel())
        if tokens.numel() >= _MIN_NEAR_TOKENS:
            context_vocab = tokens
        else:
            context["routing"] = "natural (too few token ids route near in every hash layer)"
            near = None
    decode, prefill, checks, speculative = [], [], [], []
    spec = getattr(args, "spec", None)  # bench.fullsize_spec.SpecConfig when --speculation is on
    worker.runner.capture_layer_ids = frozenset()  # target features only in drafter runs (fullsize_spec_runs)
    routings = [r for r in args.routing.split(",") if r]
    for routing in routings:
        for batch in _ints(args.batch):
            context_len = args.context if args.max_context_tokens is None else max(
                1, min(args.context, args.max_context_tokens // batch))
            prompts = _context_prompts(batch, context_len, context_vocab, args.seed + batch)
            num_tokens = args.warmup_steps + args.decode_steps + 1  # the first comes from the prefill step
            if spec is not None:  # the oracle drafts come from this run: enough for every verify step
                num_tokens = max(num_tokens, spec.num_plain_tokens(args.warmup_steps + args.decode_steps))
            began_s = time.perf_counter()
            flush_expert_timings(endpoints, cluster.timing_dir)  # drop anything recorded before this run
            dispatcher.records.clear()
            if near is not None:
                _route_near(worker, config, near, original)
            else:
                _set_routing(worker, config, routing, original, args.seed, args.skew)

            def before_decode(routing=routing):
                _set_routing(worker, config, routing, original, args.seed, args.skew)

            def stop_after(result) -> bool:
                """True once --run-budget-s has passed since the measured steps began (>= 1 measured)."""
                decode_steps = [s for s in result.steps if s.is_decode]
                if len(decode_steps) <= args.warmup_steps:
                    return False
                began_s = decode_steps[args.warmup_steps].began_s  # warm-up (compiles, graph captures) excluded
                return time.perf_counter() - began_s > args.run_budget_s

            step_tokens = min(max(2048, batch * context_len), _MAX_STEP_TOKENS)
            run_kwargs = dict(block_size_tokens=128, num_primary_blocks=blocks, max_batched_tokens=step_tokens,
                              with_logprobs=args.tiny, on_step=None if args.tiny else _print_step,
                              before_decode=before_decode)
            if spec is not None and getattr(args, "spec_diagnose", False):
                run_kwargs["num_top_logprobs"] = 2  # bench.fullsize_spec.logprob_diagnosis
            try:
                result = run_requests(worker, prompts, num_tokens, prefix=f"{routing}-b{batch}",
                                      stop_after=stop_after if args.run_budget_s is not None else None, **run_kwargs)
            except Exception as error:  # a failed run is recorded; the next one still runs
                _set_routing(worker, config, routing, original, args.seed, args.skew)
                failed = {"routing": routing, "batch": batch, "error": f"{type(error).__name__}: {error}"[:2000],
                          "run_wall_s": time.perf_counter() - began_s}
                failed["refusals"] = _explain(dispatcher, endpoints, cluster, plan)
                decode.append(failed)
                print(f"{routing} B={batch}: {failed['error'][:300]}", flush=True)
                for item in failed["refusals"]:
                    print(f"  refused at {item['worker']}: {item['verdict']}; sent {item['sent']}; received "
                          f"{ {k: item['received'][k] for k in ('layer', 'expert_ids', 'slot_mask')} }", flush=True)
                _save_partial(args, decode, prefill, context, speculative)
                if args.tiny:
                    raise
                continue
            timings = flush_expert_timings(endpoints, cluster.timing_dir)
            decode_steps = [s for s in result.steps if s.is_decode][args.warmup_steps:
                                                                      args.warmup_steps + args.decode_steps]
            analysis = analyse_steps(decode_steps, dispatcher.records, timings, **common)
            summary = analysis["summary"]
            prefill_steps = [s for s in result.steps if not s.is_decode]
            context_ids = {s.step_id for s in prefill_steps}
            context_slots = {name: sum(r[4] for r in t["records"] if r[0] in context_ids)
                             for name, t in timings.items()}
            decode.append({"routing": routing, "batch": batch,
                           "tokens_per_s": batch / summary["step_s"] if summary["step_s"] else None,
                           "floor_tokens_per_s": batch / summary["floor_s"] if summary["floor_s"] else None,
                           "summary": summary, "steps": analysis["steps"],
                           "context_prefill_s": sum(s.wall_s for s in prefill_steps),
                           "context_tokens": sum(s.num_tokens for s in prefill_steps),
                           "context_tokens_per_sequence": context_len,
                           "context_routed_slots": context_slots,  # per worker: near routing leaves far at 0
                           "stopped_early_by_budget": result.stopped_early,
                           # same weights, prompts and step count -> same greedy tokens on any data plane
                           "outputs_sha256": _outputs_hash(result.outputs),
                           "run_wall_s": time.perf_counter() - began_s,
                           "far_worker_threads": timings.get(FAR_WORKER, {}).get("num_threads"),
                           "attention_graphs": _graph_stats(worker),
                           "num_empty_selections": {n: t.get("num_empty_selections") for n, t in timings.items()}})
            print(f"{routing} B={batch}: {decode[-1]['tokens_per_s']:.2f} tok/s over {summary['num_steps']} steps "
                  f"(floor {decode[-1]['floor_tokens_per_s']:.1f}), near share {summary['near_slot_share']}",
                  flush=True)
            reference = None
            if args.tiny and not result.stopped_early:  # a stopped run has partial outputs: nothing to compare
                check, reference = _reference_check(model_dir, routing, args, prompts, num_tokens, result, batch, near)
                checks.append(check)
            if spec is not None:
                from moemesh.bench.fullsize_spec_runs import run_speculative

                def prepare_routing(routing=routing):
                    if near is not None:
                        _route_near(worker, config, near, original)
                    else:
                        _set_routing(worker, config, routing, original, args.seed, args.skew)

                def reset_timing():
                    flush_expert_timings(endpoints, cluster.timing_dir)
                    dispatcher.records.clear()

                def analyse(steps):
                    timings = flush_expert_timings(endpoints, cluster.timing_dir)
                    return analyse_steps(steps, dispatcher.records, timings, **common)["summary"]

                def on_row(row, routing=routing):  # kept at once: a wall-clock cap may end the run mid-way
                    speculative.append({"routing": routing, **row})
                    _save_partial(args, decode, prefill, context, speculative)

                _save_partial(args, decode, prefill, context, speculative)
                run_speculative(args, worker, spec, getattr(cluster, "draft_endpoint", None), prompts, num_tokens,
                                result, f"{routing}-b{batch}", summary, run_kwargs, prepare_routing, reference,
                                (reset_timing, analyse), on_row)
                _set_routing(worker, config, routing, original, args.seed, args.skew)
            _save_partial(args, decode, prefill, context, speculative)
    for num_tokens in _ints(args.prefill):
        routing = routings[-1]
        _set_routing(worker, config, routing, original, args.seed, args.skew)
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
            prefill.append({"num_tokens": num_tokens, "routing": routing, "error": f"{type(error).__name__}: {error}",
                            "refusals": _explain(dispatcher, endpoints, cluster, plan)})
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
        _save_partial(args, decode, prefill, context, speculative)
    out = {"decode": decode, "prefill": prefill, "context_method": context}
    if spec is not None:
        out["speculative"] = speculative
        out["speculation"] = {"sources": [s.value for s in spec.sources], "width": spec.width,
                              "method": "after each plain decode run, the same prompts once per draft source "
                                        "(bench/fullsize_spec.py)"}
        spec_checks = [row["reference_check"] for row in speculative if "reference_check" in row]
        if args.tiny:
            out["spec_reference_check"] = {
                "ok": bool(spec_checks) and len(spec_checks) == len(speculative)
                and all(c["tokens_equal"] for c in spec_checks)
                and all(row.get("outputs_equal_plain") for row in speculative),
                "criterion": "greedy speculative tokens equal the in-process plain run's, every token",
                "runs": spec_checks}
    if checks:
        from moemesh.bench.fullsize_reference import LOGPROB_TOLERANCE

        out["reference_check"] = {
            "ok": all(c["tokens_equal"] and c["max_abs_logprob_diff"] <= LOGPROB_TOLERANCE for c in checks),
            "criterion": f"greedy tokens equal the single-process run's (moemesh generate's loader on the same "
                         f"checkpoint) and chosen-token logprobs within {LOGPROB_TOLERANCE}",
            "runs": checks}
    return out


def _graph_stats(worker) -> dict | None:
    """The attention worker's decode-graph counters so far (None: eager worker)."""
    import dataclasses

    graphs = getattr(worker.runner, "graphs", None)
    stats = getattr(graphs, "stats", None)
    return dataclasses.asdict(stats) if stats is not None and dataclasses.is_dataclass(stats) else None


def _outputs_hash(outputs: dict[str, list[int]]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(sorted(outputs.items())).encode()).hexdigest()[:16]


def _explain(dispatcher, endpoints, cluster, plan) -> list:
    """What the workers refused in the failed run, next to what was sent (bench.fullsize_verify)."""
    from moemesh.bench.fullsize_timing import flush_expert_timings
    from moemesh.bench.fullsize_verify import explain_refusals, planned_pairs

    trace = getattr(dispatcher, "trace", None)
    if trace is None or plan is None:
        return []
    try:
        timings = flush_expert_timings(endpoints, cluster.timing_dir)
    except Exception as error:  # a worker that died cannot say what it received
        return [{"worker": "?", "verdict": f"could not ask the workers: {type(error).__name__}: {error}"[:300],
                 "sent": None, "received": {"layer": None, "expert_ids": None, "slot_mask": None}}]
    return explain_refusals(trace, timings, list(cluster.expert_names), planned_pairs(plan))


def _print_step(step) -> None:
    print(f"  step {step.step_id}: {step.num_sequences} seqs, {step.num_tokens} tokens, "
          f"{'decode' if step.is_decode else 'prefill'} {step.wall_s * 1e3:.0f} ms", flush=True)


def _save_partial(args, decode: list, prefill: list, context: dict, speculative: list | None = None) -> None:
    """The runs so far, in case a wall-clock cap ends the benchmark before its result file."""
    import json

    if args.out_dir is None:
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [{k: v for k, v in run.items() if k != "steps"} for run in decode]  # per-step rows left out
    (args.out_dir / "fullsize-partial.json").write_text(json.dumps({"partial": True, "decode": summaries,
                                                                     "prefill": prefill, "context_method": context,
                                                                     "speculative": speculative or [],
                                                                     "placement_far_device": args.experts_on},
                                                                    indent=1))


def _reference_check(model_dir, routing: str, args, prompts, num_tokens: int, result, batch: int,
                     near: torch.Tensor | None) -> tuple[dict, dict[str, list[int]]]:
    """The in-process reference with the same gate biases at the same steps (near context routing too):
    (the check, the reference's outputs by the split run's request ids)."""
    from moemesh.bench.fullsize_reference import build_reference, compare, reference_generate

    model, config = build_reference(str(model_dir))
    original = _gate_biases(model.side, config)

    class _Side:  # what _set_routing / _route_near touch: `.side`
        side = model.side

    if near is not None:
        _route_near(_Side, config, near, original)
    else:
        _set_routing(_Side, config, routing, original, args.seed, args.skew)
    ref_outputs, ref_logprobs = reference_generate(
        model, prompts, num_tokens,
        before_decode=lambda: _set_routing(_Side, config, routing, original, args.seed, args.skew))
    prefix = f"{routing}-b{batch}"
    check = compare(result.outputs, result.logprobs, ref_outputs, ref_logprobs, prefix)
    check.update(routing=routing, batch=batch)
    print(f"reference check {routing} B={batch}: {check}", flush=True)
    return check, {f"{prefix}-{i}": tokens for i, tokens in enumerate(ref_outputs)}
