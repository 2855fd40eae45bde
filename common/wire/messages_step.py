"""Control channel messages between the router and an attention worker: one step's plan and result.

Part of the wire vocabulary registered in `common/wire/messages.py` (see its docstring for the
field types the codec understands); imports no torch. The router sends StepPlan's one tensor
field (`token_masks`) as a numpy array, so it never loads torch either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from moemesh.common.wire.message_enums import RoutingPhase
from moemesh.common.wire.messages_draft import DraftProposal

if TYPE_CHECKING:  # the annotation only; nothing here imports torch at run time
    from torch import Tensor


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Invariants: `token_ids` are the tokens to compute this step, at positions
    `start_position ..< start_position + len(token_ids)`; the last `len(draft_token_ids)`
    of them are drafts to verify. `block_ids` holds the full block table per tier
    (index 0 = GPU pool). `sampling` is `SamplingParams.to_wire()`, sent at least the
    first time a sequence is scheduled (None afterwards: the worker keeps it per slot).

    Speculation (services/router/engine_drafts.py): a sampled request's drafts come with the
    sparse distribution each was drawn from (`draft_support_*[i]` for draft i, as in
    DraftProposal; empty for greedy requests). `send_features`: send this sequence's
    committed target features to the draft worker after the step. With the drafter in the
    attention worker's process (`[draft] placement = "attention"`), `draft_after` > 0 asks the
    worker to propose up to that many drafts from the token this step samples, returned in
    `SequenceResult.next_drafts`; a sampled request's drafts are drawn from stream `draft_seed`.

    `snapshot_targets`: (block index k, snapshot id) pairs: when this step's tokens cross the end of
    block k (position (k+1)·block_size), the worker records the sequence's resume snapshot there
    (services/attention/boundary.py); block ends without a pair are not recorded.
    """

    request_id: str
    seq_slot: int
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[tuple[int, ...], ...]
    do_sample: bool
    sampling: dict[str, Any] | None = None
    draft_token_ids: tuple[int, ...] = ()
    draft_support_token_ids: tuple[tuple[int, ...], ...] = ()
    draft_support_probs: tuple[tuple[float, ...], ...] = ()
    send_features: bool = False
    # With `sampling` (a sequence starting in its slot): its tokens before start_position and its
    # prompt length, so penalties and seeded random streams survive preemption and prefix hits.
    prior_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int | None = None
    # With `sampling`: the id of the HTTP request it belongs to (X-Request-Id), for the worker's logs.
    client_request_id: str | None = None
    # Constrained decoding (response_format): the first of this sequence's 1 + len(draft_token_ids)
    # rows in StepPlan.token_masks, one per sampled position in order; None: unconstrained.
    token_mask_row: int | None = None
    draft_after: int = 0
    draft_seed: int | None = None
    snapshot_targets: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class PrefixRestore:
    """Resume `seq_slot` from cached prefix blocks holding its first `num_tokens` tokens and the resume
    snapshot `snapshot_id` (primary tier) taken at that block end."""

    request_id: str
    seq_slot: int
    block_ids: tuple[int, ...]
    num_tokens: int
    snapshot_id: int


@dataclass(frozen=True)
class StepPlan:
    """Router -> attention worker: everything one step computes and every block move it needs.

    Block moves run before the step's compute: swap_out pairs are (gpu_block, cpu_block),
    swap_in pairs are (cpu_block, gpu_block), and the resume snapshots' `snapshot_swap_out` /
    `snapshot_swap_in` likewise (snapshot ids). `free_seq_slots` are released after the step.
    Plain integers only, so the router's scheduler output maps onto it without torch, except
    `token_masks`: the packed allowed-token bitmasks of constrained sequences, [M, ceil(V / 32)]
    int32 (bit j of word w allows token 32 * w + j; see services/attention/sampling/token_masks.py),
    built by the router as a numpy array and sent as one tensor frame; None when no sequence
    of the step is constrained.
    """

    TYPE: ClassVar[str] = "step_plan"
    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    free_seq_slots: tuple[int, ...] = ()
    prefix_restores: tuple[PrefixRestore, ...] = ()
    token_masks: Tensor | None = None
    snapshot_swap_out: tuple[tuple[int, int], ...] = ()
    snapshot_swap_in: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of each emitted token and, if asked, its top alternatives (same length lists)."""

    logprobs: tuple[float, ...]
    top_token_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class SequenceResult:
    """One sequence's outcome of a step: the tokens it gained (accepted drafts + sampled), and the
    drafts for its next step when the plan asked for them (`ScheduledSequence.draft_after`)."""

    request_id: str
    token_ids: tuple[int, ...]
    num_draft_accepted: int = 0
    logprobs: TokenLogprobs | None = None
    error: str | None = None
    next_drafts: DraftProposal | None = None


@dataclass(frozen=True)
class LayerRoutingSkew:
    """How unevenly one MoE layer's routed activations spread over its experts in one phase
    (see `common.placement.stats.LayerSkew`: max_over_mean 1.0 = uniform, top8_share of the
    8 hottest experts, effective_experts = exp(entropy), num_unused never selected)."""

    layer: int
    phase: RoutingPhase
    num_activations: int
    max_over_mean: float
    top8_share: float
    effective_experts: float
    num_unused: int


@dataclass(frozen=True)
class RoutingSummary:
    """The attention worker's routing statistics since it started, reduced to per-layer skew:
    one entry per (measured phase, layer) plus the ALL phase for every layer. `layer_counts`
    carries the raw activations per (layer, expert), all phases together, [L][E] (the status
    page's heat map; L x E ints every few steps is small next to a step's tensors); empty when
    the sender does not send them."""

    num_steps: int
    layers: tuple[LayerRoutingSkew, ...]
    layer_counts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepCounters:
    """What one step cost the attention worker's host, counted while it ran (retries included): `decode`
    every sequence computed one new token (plus its drafts); `num_layers` the model's; `data_messages`
    ZeroMQ messages sent to expert workers for layers (Dispatch, DispatchSlot; not the step plan and
    result, nor a mailbox offer); `host_syncs` synchronising CUDA calls torch saw (its sync debug mode,
    `MOEMESH_COUNT_HOST_SYNCS=1`), -1 when not counted."""

    decode: bool
    num_layers: int
    data_messages: int
    host_syncs: int = -1


@dataclass(frozen=True)
class StepResult:
    """Attention worker -> router, the answer to one StepPlan (same step_id). `routing` is
    attached every few steps (the worker's `summary_every_steps`), None otherwise. `draft_s`:
    wall time the step spent proposing next drafts in the worker's process (0 without)."""

    TYPE: ClassVar[str] = "step_result"
    step_id: int
    sequences: tuple[SequenceResult, ...]
    routing: RoutingSummary | None = None
    counters: StepCounters | None = None
    draft_s: float = 0.0
