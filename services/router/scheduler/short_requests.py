"""How the scheduler keeps a short request's first token from waiting on a long prompt. Plain Python.

Short: a prompt of at most long_prefill_token_threshold tokens (one chunk); long: more.
- Sit-out: when a short prompt heads the waiting queue and a running slot is free, running long
  prompts that still need more than one token skip the step, so the short prompt starts in a short
  step, not beside a chunk that attends over a long history. A long prompt never sits out two steps
  in a row (it keeps at least half its pace under a stream of short arrivals); the scheduler runs it
  after all when nothing new was admitted.
- Shared chunks: while short requests are about (one arrived within short_request_window_s), a long
  prompt computes at most shared_prefill_token_threshold tokens a step (`budget.chunk_cap`), so a
  short arrival waits on a short chunk in flight, not a full one.
"""

from __future__ import annotations

from collections.abc import Sequence

from moemesh.services.router.scheduler.config import SchedulerConfig
from moemesh.services.router.scheduler.request import Request


class ShortRequestPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.about = False  # short requests are about this step (set by begin_step)
        self._last_short_arrival_s = float("-inf")
        self._sat_out_ids: frozenset[str] = frozenset()  # long prompts that sat out the last step

    def note_arrival(self, request: Request, now_s: float) -> None:
        if request.num_tokens <= self.config.long_prefill_token_threshold:
            self._last_short_arrival_s = now_s

    def begin_step(self, now_s: float, waiting: Sequence[Request], running: Sequence[Request],
                   any_swapped: bool) -> frozenset[str]:
        """Set `about` for this step; -> the running long prompts that sit it out."""
        self.about = now_s - self._last_short_arrival_s < self.config.short_request_window_s
        threshold = self.config.long_prefill_token_threshold
        if (not waiting or any_swapped or waiting[0].num_tokens > threshold
                or len(running) >= self.config.max_num_running_seqs):
            return frozenset()
        return frozenset(
            request.request_id
            for request in running
            if request.num_prompt_tokens > threshold
            and request.num_tokens - request.num_computed_tokens > 1
            and request.request_id not in self._sat_out_ids
        )

    def end_step(self, sat_out_ids: frozenset[str]) -> None:
        """The long prompts that did sit out this step (none when they ran after all)."""
        self._sat_out_ids = sat_out_ids
