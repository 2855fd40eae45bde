"""The speculative runs of `bench.fullsize --speculation` (sources and figures: `bench.fullsize_spec`).

After a plain decode run of (routing, batch), `run_speculative` runs the same prompts once per draft
source, with the context routed and the decode gate biases set exactly as in the plain run, and
returns one row per source: its figures (`spec_row`), its token-for-token comparison with the plain
run's output (`compare_outputs`) and, with --tiny, with the in-process reference's. A full-size run
stops a source's run after --warmup-steps + --decode-steps verify steps (or --run-budget-s); a tiny
run generates every token, so the reference comparison covers whole outputs. Target features are
captured (and sent to the draft worker) only during drafter runs, so plain and oracle runs do not pay
for the capture.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def run_speculative(args, worker, spec, drafter_endpoint: str | None, prompts: list[list[int]], num_tokens: int,
                    plain, plain_prefix: str, plain_summary: dict, run_kwargs: dict[str, Any],
                    prepare_routing: Callable[[], None], reference: dict[str, list[int]] | None,
                    timing: tuple[Callable[[], None], Callable[[list], dict]] | None = None,
                    on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per source of `spec` (a failed source is a row with "error"; --tiny re-raises).

    plain: the plain run's RunResult; plain_summary: its analysis summary (median step);
    run_kwargs: run_requests' keyword arguments of the plain run (blocks, budget, before_decode);
    prepare_routing(): sets the gate biases for the context prefill as the plain run had them;
    reference: --tiny's in-process outputs by plain request id (None: no reference);
    timing: (reset, analyse): reset() drops the dispatch records so far, analyse(steps) gives the
    `bench.fullsize_report.analyse_steps` summary of the verify steps (where their time went);
    on_row(row): called with each row as soon as it is made (partial results)."""
    from moemesh.bench.fullsize_spec import DraftSource, DrafterDrafts, OracleDrafts, compare_outputs, logprob_diagnosis
    from moemesh.bench.fullsize_spec import spec_row
    from moemesh.bench.fullsize_timing import run_requests

    batch = len(prompts)
    rows = []
    plain_outputs = [plain.outputs[f"{plain_prefix}-{i}"] for i in range(batch)]
    plain_tokens_per_s = batch / plain_summary["step_s"] if plain_summary.get("step_s") else None
    from moemesh.services.attention.speculation import capture_layer_ids

    drafter_capture_ids = frozenset(capture_layer_ids(worker.side.config)) if drafter_endpoint else frozenset()
    for source in spec.sources:
        prefix = f"{plain_prefix}-{source.value}"
        began_s = time.perf_counter()
        drafts = None
        try:
            if source is DraftSource.ORACLE:
                drafts = OracleDrafts(plain_outputs, prefix, spec.width)
            else:
                if drafter_endpoint is None:
                    raise RuntimeError("no draft worker (it did not start: draft_worker.error in the result)")
                drafts = DrafterDrafts(drafter_endpoint, spec.width, spec.draft_timeout_s)
            uses_drafter = source is DraftSource.DRAFTER
            worker.runner.capture_layer_ids = drafter_capture_ids if uses_drafter else frozenset()
            prepare_routing()
            if timing is not None:
                timing[0]()
            result = run_requests(worker, prompts, num_tokens, prefix=prefix, drafts=drafts,
                                  send_features=uses_drafter, stop_after=None if args.tiny else _stop_after(args),
                                  **run_kwargs)
        except Exception as error:  # recorded; the next source still runs
            row = {"source": source.value, "width": spec.width, "batch": batch,
                   "error": f"{type(error).__name__}: {error}"[:2000], "run_wall_s": time.perf_counter() - began_s}
            rows.append(row)
            if on_row is not None:
                on_row(row)
            print(f"speculation {source.value} B={batch}: {row['error'][:300]}", flush=True)
            if args.tiny:
                raise
            continue
        finally:
            worker.runner.capture_layer_ids = frozenset()  # plain and oracle runs capture nothing
            if isinstance(drafts, DrafterDrafts):
                drafts.close()
        row = spec_row(source, spec.width, result, args.warmup_steps, plain_summary.get("step_s"),
                       plain_tokens_per_s, batch)
        row.update(compare_outputs(plain.outputs, result.outputs, plain_prefix, prefix))
        if run_kwargs.get("num_top_logprobs"):
            row["logprob_diagnosis"] = diagnosis = logprob_diagnosis(plain, result, plain_prefix, prefix)
            print(f"  logprobs before the first mismatch: median |diff| {diagnosis['abs_logprob_diff_median']}, max "
                  f"{diagnosis['abs_logprob_diff_max']} over {diagnosis['num_positions_compared']} positions; at "
                  f"mismatches: {[(m['position'], m['plain_margin'], m['spec_margin']) for m in diagnosis['mismatches']]}",
                  flush=True)
        if timing is not None:
            verify = [s for s in result.steps if s.is_decode][args.warmup_steps:]
            row["verify_summary"] = timing[1]([s for s in verify if s.num_drafts])
        if source is DraftSource.ORACLE:
            # greedy verification of the target's own continuation must accept every draft
            row["oracle_all_accepted"] = row["num_accepted"] == row["num_drafts"] and row["num_drafts"] > 0
            row["oracle_num_short"] = drafts.num_short
        else:
            row["drafter_num_proposed"] = drafts.num_proposed
            row["drafter_num_empty"] = drafts.num_empty
        if reference is not None:
            row["reference_check"] = _reference_row(reference, result, plain_prefix, prefix)
        row["run_wall_s"] = time.perf_counter() - began_s
        rows.append(row)
        if on_row is not None:
            on_row(row)
        print(f"speculation {source.value} B={batch} W={spec.width}: {_fmt(row['tokens_per_s'])} tok/s, tau "
              f"{_fmt(row['tau'])}, verify step {_ms(row['verify_step_s'])} vs plain {_ms(row['plain_step_s'])}, "
              f"drafter {_ms(row['draft_round_trip_s'])}, output = plain: {row['outputs_equal_plain']}"
              + ("" if row["outputs_equal_plain"] else f" first mismatch {row['first_mismatch']}"), flush=True)
    return rows


def _stop_after(args):
    """Stop a speculative run after warm-up + measured verify steps, or --run-budget-s of them."""
    def stop(result) -> bool:
        decode = [s for s in result.steps if s.is_decode]
        if len(decode) >= args.warmup_steps + args.decode_steps:
            return True
        if args.run_budget_s is None or len(decode) <= args.warmup_steps:
            return False
        return time.perf_counter() - decode[args.warmup_steps].began_s > args.run_budget_s
    return stop


def _reference_row(reference: dict[str, list[int]], result, plain_prefix: str, prefix: str) -> dict:
    """The speculative outputs against the in-process plain reference: every token equal."""
    from moemesh.bench.fullsize_spec import compare_outputs

    check = compare_outputs(reference, result.outputs, plain_prefix, prefix)
    complete = all(len(result.outputs[f"{prefix}-{i}"]) == len(reference[f"{plain_prefix}-{i}"])
                   for i in range(len(reference)))
    return {"tokens_equal": check["outputs_equal_plain"] and complete, "complete": complete,
            "num_tokens": check["num_tokens_compared"], "first_mismatch": check["first_mismatch"]}


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


__all__ = ["run_speculative"]
