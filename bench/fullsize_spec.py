"""Speculation in `bench.fullsize`: draft sources and the figures of a speculative run.

`--speculation oracle,drafter` adds, after each plain decode run (routing, batch), one run per draft
source over the same prompts, seed and routing, driven by the router's scheduler (drafts: within
the budget and max_tokens, accepted tokens + bonus, rejected drafts' blocks freed):
- `OracleDrafts` (oracle): drafts are the target's own greedy continuation, recorded in the plain
  run. Greedy verification must accept them all, so the run measures the verification path at full
  acceptance (tau = width + 1, an upper bound); any rejected oracle draft, or any output token that
  differs from the plain run's, is a correctness failure: greedy speculative output must equal plain
  output token for token, and the run's row says so (`outputs_equal_plain`, `first_mismatch`).
- `DrafterDrafts` (drafter): the real draft worker process (`moemesh draft`, services/draft) asked
  for one block per step as the router asks it (DraftRequest -> DraftTokens, one slot per request in
  decode, seed = its newest token), fed target features by the attention worker itself
  (`AttentionWorkerConfig.draft_endpoint`, `ScheduledSequence.send_features`). On random weights
  its drafts are almost always rejected: this measures the cost side (drafter round trip, verify
  step of width 1 + k) with tau as measured, never assumed.
Figures of a speculative run (`spec_row`), over its measured decode steps (after --warmup-steps):
tokens/s = tokens gained / (step wall + the drafter round trip before it); tau = tokens gained per
sequence per step (bonus included); the median verify step (steps that carried drafts; the last
steps of a run may have no room left for drafts) against the same run's plain step median; the
drafter round trip median; acceptance rate. Greedy only (temperature 0).
Legend: B sequences, W drafts per step (--spec-width).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from moemesh.bench.timing import median

_median_or_none = partial(median, empty=None)


class DraftSource(enum.Enum):
    ORACLE = "oracle"
    DRAFTER = "drafter"


@dataclass(frozen=True)
class SpecConfig:
    """sources: draft sources run after each plain run, in order; width: drafts per request and step
    (at most the drafter's block size); draft_timeout_s: bound on one DraftRequest round trip."""

    sources: tuple[DraftSource, ...]
    width: int = 5
    draft_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"--spec-width {self.width}: must be >= 1")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"--speculation lists a source twice: {[s.value for s in self.sources]}")

    @property
    def uses_drafter(self) -> bool:
        return DraftSource.DRAFTER in self.sources

    def num_plain_tokens(self, num_verify_steps: int) -> int:
        """Tokens the plain run generates so the oracle has drafts for `num_verify_steps` full-width
        verify steps: the prefill's token, then W + 1 per step."""
        return 1 + num_verify_steps * (self.width + 1)


def parse_sources(text: str) -> tuple[DraftSource, ...]:
    """"off" / "" -> (); else a comma-separated list of oracle, drafter."""
    names = [name.strip() for name in text.split(",") if name.strip() and name.strip() != "off"]
    try:
        return tuple(DraftSource(name) for name in names)
    except ValueError:
        raise ValueError(f"--speculation {text!r}: expected off or a list of "
                         f"{[s.value for s in DraftSource]}") from None


class OracleDrafts:
    """Drafts = the plain run's greedy continuation: request index i's output `plain[i]`.

    A request that has generated n tokens (its seed is output n - 1) gets plain[i][n : n + W]."""

    source = DraftSource.ORACLE

    def __init__(self, plain_outputs: list[list[int]], prefix: str, width: int) -> None:
        self.plain = {f"{prefix}-{i}": list(tokens) for i, tokens in enumerate(plain_outputs)}
        self.width = width
        self.num_short = 0  # requests the plain run had too few tokens for (drafts cut short)

    def propose(self, engine) -> float:
        started_s = time.perf_counter()
        for request, max_drafts in engine.draft_candidates():
            num_out = request.num_output_tokens
            want = min(self.width, max_drafts)
            drafts = self.plain[request.request_id][num_out:num_out + want]
            self.num_short += int(len(drafts) < want)
            if drafts:
                engine.set_drafts(request.request_id, drafts)
        return time.perf_counter() - started_s

    def finish(self, engine) -> None:
        pass


class DrafterDrafts:
    """The draft worker at `endpoint`, asked as the router asks it (services/router/engine_drafts.py):
    one DraftRequest per step with a DraftSlot for every request in decode; finished requests are
    named in the next request (the drafter drops their feature rings)."""

    source = DraftSource.DRAFTER

    def __init__(self, endpoint: str, width: int, timeout_s: float) -> None:
        import zmq

        from moemesh.common.wire.transport import SyncClient

        self.width = width
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self.client = SyncClient(endpoint, context=self._context, default_timeout_s=timeout_s)
        self._step_ids = 0
        self._known: set[str] = set()
        self.round_trips_s: list[float] = []
        self.num_proposed = 0  # drafts the drafter returned
        self.num_empty = 0  # slots it answered without drafts

    def propose(self, engine) -> float:
        from moemesh.common.wire.messages import DraftRequest, DraftSlot, DraftTokens, ErrorReply

        slots = []
        for request, max_drafts in engine.draft_candidates():
            seed_position = request.num_tokens - 1
            slots.append(DraftSlot(request_id=request.request_id, num_draft_tokens=min(self.width, max_drafts),
                                   last_token_ids=(request.token_id_at(seed_position),), start_position=seed_position))
            self._known.add(request.request_id)
        finished = self._finished(engine)
        if not slots and not finished:
            return 0.0
        self._step_ids += 1
        started_s = time.perf_counter()
        reply = self.client.request(DraftRequest(step_id=self._step_ids, slots=tuple(slots),
                                                 finished_request_ids=tuple(finished)))
        elapsed_s = time.perf_counter() - started_s
        match reply:
            case DraftTokens():
                pass
            case ErrorReply(code=code, message=message):
                raise RuntimeError(f"draft worker refused a DraftRequest: {code.value}: {message[:300]}")
            case _:
                raise RuntimeError(f"draft worker answered {type(reply).__name__} to a DraftRequest")
        for proposal in reply.proposals:
            if proposal.token_ids:
                engine.set_drafts(proposal.request_id, proposal.token_ids)
                self.num_proposed += len(proposal.token_ids)
            else:
                self.num_empty += 1
        if slots:
            self.round_trips_s.append(elapsed_s)
        return elapsed_s

    def _finished(self, engine) -> list[str]:
        done = [rid for rid in self._known if engine.outputs[rid].finish_reason is not None]
        self._known.difference_update(done)
        return sorted(done)

    def finish(self, engine) -> None:
        """Tell the drafter every request of the run is over (their rings go)."""
        from moemesh.common.wire.messages import DraftRequest

        done = self._finished(engine) + sorted(self._known)
        self._known.clear()
        if done:
            self._step_ids += 1
            self.client.request(DraftRequest(step_id=self._step_ids, slots=(), finished_request_ids=tuple(done)))

    def close(self) -> None:
        self.client.close()
        self._context.term()


def compare_outputs(plain: dict[str, list[int]], spec: dict[str, list[int]], plain_prefix: str,
                    spec_prefix: str) -> dict[str, Any]:
    """Token-for-token equality of the speculative run's outputs with the plain run's, over the
    tokens both have (a run stopped by its step count or time cap has a prefix of the plain output)."""
    num_compared, first = 0, None
    for spec_id, tokens in sorted(spec.items()):
        index = spec_id.removeprefix(f"{spec_prefix}-")
        reference = plain[f"{plain_prefix}-{index}"]
        common = min(len(tokens), len(reference))
        num_compared += common
        for position in range(common):
            if tokens[position] != reference[position]:
                first = first or {"request": int(index), "position": position, "spec": tokens[position],
                                  "plain": reference[position]}
                break
    return {"outputs_equal_plain": first is None and num_compared > 0, "num_tokens_compared": num_compared,
            "first_mismatch": first}


def logprob_diagnosis(plain, spec, plain_prefix: str, spec_prefix: str, max_items: int = 4) -> dict[str, Any]:
    """Why a speculative output left the plain one (--spec-diagnose: both runs kept top-2 logprobs).

    Before its first mismatch a request's context is the same in both runs, so the chosen tokens'
    logprobs differ only by how the two paths compute (one-token decode against the rows of a
    verify chunk): `abs_logprob_diff_*` measures that noise. At the mismatch, `plain_margin` is the
    plain run's top-1 minus top-2 logprob there: a margin within the noise is a near tie that
    rounding decides (numerics); a margin far above it means the verify path computed something else
    (a bug). Positions are output positions (0 comes from the prefill step, the same in both runs)."""
    diffs, items = [], []
    for spec_id, tokens in sorted(spec.outputs.items()):
        index = spec_id.removeprefix(f"{spec_prefix}-")
        plain_id = f"{plain_prefix}-{index}"
        reference = plain.outputs[plain_id]
        common = min(len(tokens), len(reference))
        mismatch = next((p for p in range(common) if tokens[p] != reference[p]), None)
        spec_lp, plain_lp = spec.logprobs.get(spec_id, []), plain.logprobs.get(plain_id, [])
        for position in range(min(common if mismatch is None else mismatch, len(spec_lp), len(plain_lp))):
            diffs.append(abs(spec_lp[position] - plain_lp[position]))
        if mismatch is None or len(items) >= max_items:
            continue
        plain_top = _top(plain, plain_id, mismatch)
        spec_top = _top(spec, spec_id, mismatch)
        items.append({"request": int(index), "position": mismatch, "plain_top": plain_top, "spec_top": spec_top,
                      "plain_margin": plain_top[0][1] - plain_top[1][1] if len(plain_top) > 1 else None,
                      "spec_margin": spec_top[0][1] - spec_top[1][1] if len(spec_top) > 1 else None})
    diffs.sort()
    return {"num_positions_compared": len(diffs),
            "abs_logprob_diff_median": diffs[len(diffs) // 2] if diffs else None,
            "abs_logprob_diff_max": diffs[-1] if diffs else None,
            "mismatches": items}


def _top(result, request_id: str, position: int) -> list[tuple[int, float]]:
    tops = result.top_logprobs.get(request_id, [])
    if position >= len(tops):
        return []
    ids, values = tops[position]
    return [(int(i), float(v)) for i, v in zip(ids, values)]


def spec_row(source: DraftSource, width: int, result, num_warmup: int, plain_step_s: float | None,
             plain_tokens_per_s: float | None, batch: int) -> dict[str, Any]:
    """The figures of one speculative run (see the module docstring) from its TimedSteps; plain_*: the
    plain run of the same prompts (its median step and batch / that step)."""
    measured = [s for s in result.steps if s.is_decode][num_warmup:]
    verify = [s for s in measured if s.num_drafts]  # the last steps of a run may have no room for drafts
    tokens = sum(s.num_tokens_gained for s in measured)
    seconds = sum(s.wall_s + s.draft_s for s in measured)
    seq_steps = sum(s.num_sequences for s in measured)
    drafted = sum(s.num_drafts for s in measured)
    accepted = sum(s.num_accepted for s in measured)
    step_s = _median_or_none([s.wall_s for s in verify])
    draft_s = [s.draft_s for s in verify]
    tokens_per_s = tokens / seconds if seconds else None
    return {
        "source": source.value, "width": width, "batch": batch, "num_verify_steps": len(verify),
        "num_steps_without_drafts": len(measured) - len(verify),
        "tokens_per_s": tokens_per_s,
        "tau": tokens / seq_steps if seq_steps else None,  # tokens per sequence per verify step, bonus included
        "num_tokens_gained": tokens, "num_drafts": drafted, "num_accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "verify_step_s": step_s, "plain_step_s": plain_step_s,
        "verify_over_plain_step": step_s / plain_step_s if step_s and plain_step_s else None,
        "draft_round_trip_s": _median_or_none(draft_s) if source is DraftSource.DRAFTER else None,
        "speedup_over_plain": tokens_per_s / plain_tokens_per_s if tokens_per_s and plain_tokens_per_s else None,
        "tokens_per_verify_step": [s.num_tokens_gained for s in verify],
        "drafts_per_verify_step": [s.num_drafts for s in verify],
        "stopped_early": result.stopped_early,
    }


def print_spec_rows(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"{'routing':8} {'B':>3} {'source':8} {'W':>2} {'tok/s':>8} {'tau':>5} {'acc %':>6} {'verify ms':>10} "
          f"{'plain ms':>9} {'x plain':>8} {'draft ms':>9} {'speedup':>8} {'equal':>6} {'steps':>5} {'attn/wait ms':>13}")
    for row in rows:
        if "error" in row:
            print(f"{row['routing']:8} {row['batch']:>3} {row['source']:8}  failed: {row['error'][:150]}")
            continue
        print(f"{row['routing']:8} {row['batch']:>3} {row['source']:8} {row['width']:>2} "
              f"{_fmt(row['tokens_per_s'], 8, 2)} {_fmt(row['tau'], 5, 2)} "
              f"{_fmt(None if row['acceptance_rate'] is None else 100 * row['acceptance_rate'], 6, 1)} "
              f"{_fmt_ms(row['verify_step_s'], 10)} {_fmt_ms(row['plain_step_s'], 9)} "
              f"{_fmt(row['verify_over_plain_step'], 8, 2)} {_fmt_ms(row['draft_round_trip_s'], 9)} "
              f"{_fmt(row['speedup_over_plain'], 8, 2)} {str(row['outputs_equal_plain']):>6} "
              f"{row['num_verify_steps']:>5} {_split_ms(row.get('verify_summary')):>13}")


def _split_ms(summary: dict[str, Any] | None) -> str:
    """The verify steps' median attention side / wait for experts, in ms."""
    if not summary or not summary.get("num_steps"):
        return "-"
    return f"{summary['attention_side_s'] * 1e3:.1f}/{summary['wait_s'] * 1e3:.1f}"


def markdown_spec_rows(result: dict[str, Any], label: str) -> list[str]:
    """One markdown row per speculative run: | config | routing | B | source (W) | tok/s | tau | verify ms
    (x plain) | verify attention / wait ms | drafter ms | speedup | output = plain |."""
    rows = []
    for row in result.get("speculative", []):
        head = f"| {label} | {row['routing']} | {row['batch']} | {row['source']} (W={row.get('width')}) |"
        if "error" in row:
            rows.append(f"{head} failed: {row['error'][:120]} |||||||")
            continue
        rows.append(
            f"{head} {_fmt(row['tokens_per_s'], 0, 2)} | {_fmt(row['tau'], 0, 2)} | "
            f"{_fmt_ms(row['verify_step_s'], 0)} ({_fmt(row['verify_over_plain_step'], 0, 2)}x plain "
            f"{_fmt_ms(row['plain_step_s'], 0)}) | {_split_ms(row.get('verify_summary'))} | "
            f"{_fmt_ms(row['draft_round_trip_s'], 0)} | "
            f"{_fmt(row['speedup_over_plain'], 0, 2)} | {_equal_text(row)} |")
    return rows


def _equal_text(row: dict[str, Any]) -> str:
    if row["outputs_equal_plain"]:
        return f"yes ({row['num_tokens_compared']} tokens)"
    mismatch = row.get("first_mismatch")
    return f"NO: {mismatch}" if mismatch else "nothing compared"


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _fmt_ms(seconds: float | None, width: int) -> str:
    return _fmt(None if seconds is None else 1e3 * seconds, width, 1)


__all__ = ["DraftSource", "DrafterDrafts", "OracleDrafts", "SpecConfig", "compare_outputs", "logprob_diagnosis",
           "markdown_spec_rows",
           "parse_sources", "print_spec_rows", "spec_row"]
