"""Proposing drafts with the DSpark drafter: target features in, a block of drafts per request out.

State: one `FeatureRing` per live request (fused features of its last 128 positions; a draft reads the
committed ones).
- `add_features(TargetFeatures)`: fuse and append each segment's rows to its request's ring. Rows
  starting at position p replace whatever the ring held at positions >= p (rejected drafts'
  features), so rollback needs nothing of its own.
- `propose(DraftRequest)`: drop the finished requests' rings, then all drafted requests go through
  the three stages in one batched forward (contexts padded to the longest ring, padding masked
  out), then the Markov chains of all of them run together, slot by slot (greedy, or sampled from a
  sparse exact q: chains.batched_chains, one host transfer at the end; with `draft_sampling="greedy"` a
  sampled request takes the greedy chain and each draft's q is all on it), and each request gets its
  width from its confidences (common/speculation_width.py). On a CUDA device with `cuda_graphs`, the
  forward and the chains (greedy and sampled) are one replay of a captured graph (draft_graphs.py)
  whenever the drafted requests fit its buckets. Every slot of the request gets a
  proposal, empty when it asked for no drafts or speculation is off.

The draft worker service (`services/draft/worker.py`) and the attention worker's in-process drafter
(`services/attention/local_drafter.py`) both run a `DraftProposer`. Routed experts of the stages
run in this process (`RoutedExperts` from `load_mtp`), so a draft step needs no network hop.
Legend: A drafted requests, C context positions (padded), G block slots, D hidden, F = L·D raw
feature width, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
import torch

from moemesh.common.drafting.chains import RowChains, batched_chains, draft_keys, replay_row_chains
from moemesh.common.drafting.feature_ring import FeatureRings
from moemesh.common.drafting.options import DEFAULT_DRAFT_SAMPLING, DEFAULT_MAX_SUPPORT, DRAFT_SAMPLING_CHOICES
from moemesh.common.model.config import ModelConfig, NumericsConfig
from moemesh.common.model.dspark import DSparkDrafter
from moemesh.common.speculation_width import SpeculationConfig, choose_width
from moemesh.common.wire.messages import DraftProposal, DraftRequest, DraftSlot, DraftTokens, TargetFeatures

log = structlog.get_logger("draft")

@dataclass(frozen=True)
class DrafterConfig:
    """name: who runs it (the draft worker's service name, or `<attention worker>/draft`); checkpoint_path:
    model directory (config.json + safetensors);
    dtype: "auto" (float32 on CPU, bfloat16 elsewhere) or a dtype name; speculation: the width
    policy (None: the model's default, adaptive up to dspark_block_size); max_support: tokens
    kept in a sampled slot's proposal distribution (None: the full vocabulary, large on the wire);
    draft_sampling: "greedy" drafts a sampled request's argmax chain with all of q on each draft (no
    supports to draw or send), "sampled" draws its chain from the truncated q (options.py);
    cuda_graphs: on a CUDA device, replay the block forward as CUDA graphs (draft_graphs.py)."""

    name: str = "draft"
    checkpoint_path: str = ""
    device: str = "cpu"
    dtype: str = "auto"
    speculation: SpeculationConfig | None = None
    max_support: int | None = DEFAULT_MAX_SUPPORT
    draft_sampling: str = DEFAULT_DRAFT_SAMPLING
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.draft_sampling not in DRAFT_SAMPLING_CHOICES:
            raise ValueError(f"draft_sampling={self.draft_sampling!r}: one of {', '.join(DRAFT_SAMPLING_CHOICES)}")


def resolve_numerics(dtype: str, device: str) -> NumericsConfig:
    if dtype == "auto":
        dtype = "float32" if torch.device(device).type == "cpu" else "bfloat16"
    return NumericsConfig(dtype)


def load_drafter(checkpoint_path: str, device: str, numerics: NumericsConfig, *,
                 on_progress=None) -> DSparkDrafter:
    """`mtp.*` (stages, heads, routed experts) plus its own copy of the target's embed and head;
    nothing else of the target is read. FP8 linears stay FP8 and the stages' routed experts stay in
    their stored format (common/checkpoint/side_loading.py). on_progress: the runner's load-progress
    callback (bytes and tensors read, for the log and the status page)."""
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.checkpoint.side_loading import load_drafter as read_drafter

    from moemesh.common.checkpoint.side_loading import drafter_stored_bytes

    reader = CheckpointReader(checkpoint_path, on_progress=on_progress)
    drafter = read_drafter(reader, numerics, device)
    drafter.stored_weight_bytes = drafter_stored_bytes(reader)  # what the drafter holds, as stored
    return drafter


@dataclass
class _Batch:
    """The padded inputs of one batched draft forward."""

    main_x: torch.Tensor  # [A, C, D]
    context_positions: torch.Tensor  # [A, C] int64
    context_valid: torch.Tensor  # [A, C] bool
    block_token_ids: torch.Tensor  # [A, G]
    block_positions: torch.Tensor  # [A, G]
    seed_positions: list[int] = field(default_factory=list)


@dataclass
class DraftTimings:
    """Wall time spent inside the drafter (host clock; CUDA work is synchronised by the replies'
    .tolist()), summed since start: where a speculative step's drafter share goes."""

    num_proposals: int = 0
    num_drafted_requests: int = 0
    propose_s_total: float = 0.0
    forward_s_total: float = 0.0  # the stages and the head (block_hidden + base_logits), device-synchronised
    chains_s_total: float = 0.0  # Markov chains, confidences, widths, the reply's lists
    num_feature_messages: int = 0
    num_feature_rows: int = 0
    features_s_total: float = 0.0

    def as_log_fields(self) -> dict[str, float | int]:
        return {"num_proposals": self.num_proposals, "num_drafted_requests": self.num_drafted_requests,
                "propose_ms_mean": 1e3 * self.propose_s_total / max(1, self.num_proposals),
                "forward_ms_mean": 1e3 * self.forward_s_total / max(1, self.num_proposals),
                "chains_ms_mean": 1e3 * self.chains_s_total / max(1, self.num_proposals),
                "num_feature_messages": self.num_feature_messages, "num_feature_rows": self.num_feature_rows,
                "features_ms_mean": 1e3 * self.features_s_total / max(1, self.num_feature_messages)}


class DraftProposer:
    """The drafter, its rings and its timings. drafter: an already built drafter (tests,
    single-process use); None: `load_now()` reads config.checkpoint_path."""

    def __init__(self, config: DrafterConfig, drafter: DSparkDrafter | None = None) -> None:
        self.config = config
        self.drafter: DSparkDrafter | None = None
        self.speculation: SpeculationConfig | None = None
        self.rings: FeatureRings | None = None
        self.graphs = None  # draft_graphs.DraftGraphs on a CUDA device with config.cuda_graphs
        self.timings = DraftTimings()
        if drafter is not None:
            self._install(drafter)

    def _install(self, drafter: DSparkDrafter) -> None:
        model: ModelConfig = drafter.config
        block_size = model.dspark.block_size
        speculation = self.config.speculation or SpeculationConfig.for_model(None, None, block_size)
        self.speculation = speculation.validate_block_size(block_size)
        self.drafter = drafter
        self.device = drafter.head.weight.device
        # spare entries: a verify step's drafts (at most a block) may be appended before verification decides
        self.rings = FeatureRings(model.sliding_window, model.hidden_size, dtype=drafter.dtype, device=self.device,
                                  spare_positions=block_size)
        if self.config.cuda_graphs and self.device.type == "cuda":
            from moemesh.common.drafting.draft_graphs import DraftGraphs

            if DraftGraphs.capturable(drafter):
                self.graphs = DraftGraphs(drafter, model.sliding_window, self.config.max_support)

    def load_now(self, on_progress=None) -> None:
        """Read the drafter from config.checkpoint_path (on_progress: bytes and tensors read)."""
        numerics = resolve_numerics(self.config.dtype, self.config.device)
        self._install(load_drafter(self.config.checkpoint_path, self.config.device, numerics, on_progress=on_progress))

    def num_live_requests(self) -> int:
        return 0 if self.rings is None else len(self.rings)

    # ------------------------------------------------------------------ features
    @torch.no_grad()
    def add_features(self, message: TargetFeatures) -> None:
        """Fuse every segment's rows ([n, F] -> [n, D]) and append them to its request's ring (timed)."""
        started_s = time.perf_counter()
        features = message.features
        expected_width = len(self.drafter.dspark.target_layer_ids) * self.drafter.config.hidden_size
        if features.dim() != 2 or features.shape[1] != expected_width:
            raise ValueError(f"target features {tuple(features.shape)}: expected [N, {expected_width}]")
        for segment in message.segments:
            end = segment.row_start + segment.num_rows
            if segment.row_start < 0 or end > features.shape[0]:
                raise ValueError(f"{segment.request_id}: rows {segment.row_start}..{end} outside {features.shape[0]}")
            rows = features[segment.row_start:end].to(self.device)  # [n, F]
            self.rings.append(segment.request_id, segment.start_position, self.drafter.fuse_features(rows))
        self.timings.num_feature_messages += 1
        self.timings.num_feature_rows += int(features.shape[0])
        self.timings.features_s_total += time.perf_counter() - started_s

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def propose(self, request: DraftRequest) -> DraftTokens:
        """Drafts for every slot of `request`: one batched forward, then per-request chains and widths (timed)."""
        proposed_s = time.perf_counter()
        for request_id in request.finished_request_ids:
            self.rings.drop(request_id)
        drafted = [slot for slot in request.slots if self._wants_drafts(slot)]
        rows: dict[str, DraftProposal] = {}
        if drafted:
            contexts, seed_positions = self._contexts(drafted)
            seed_token_ids = [slot.last_token_ids[-1] for slot in drafted]
            started_s = time.perf_counter()
            replay = None
            # the chains' temperature per row: with greedy drafting every row takes the argmax chain
            temperatures = [float(slot.temperature) if self.config.draft_sampling == "sampled" else 0.0
                            for slot in drafted]
            sampled = [t > 0 for t in temperatures]
            if self.graphs is not None:
                keys = None  # the DRAFT keys of every row (greedy rows: zeros, unused) when the graph draws
                if any(sampled) and self.graphs.support_k is not None:
                    keys = draft_keys([slot.seed or 0 for slot in drafted],
                                      [slot.first_output_position or 0 for slot in drafted],
                                      self.drafter.dspark.block_size, "cpu")
                try:
                    replay = self.graphs.run(contexts, seed_token_ids, seed_positions, temperatures, keys)
                except RuntimeError as error:  # a capture that failed: drafts go on eagerly, said once
                    self.graphs = None
                    log.error("draft.graphs_off", error=str(error)[:300], action="the drafter runs eagerly")
            if replay is not None:
                hidden, base_logits = replay.hidden, replay.base_logits  # [A, G, D], [A, G, V]
            else:
                batch = self._padded_batch(contexts, seed_token_ids, seed_positions)
                hidden = self.drafter.block_hidden(batch.main_x, batch.context_positions, batch.context_valid,
                                                   batch.block_token_ids, batch.block_positions)  # [A, G, D]
                base_logits = self.drafter.base_logits(hidden)  # [A, G, V]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # one sync per proposal, so the split below is true
            forward_done_s = time.perf_counter()
            if replay is not None and (replay.support_ids is not None or not any(sampled)):
                chains = replay_row_chains(replay.chains, replay.support_ids, replay.support_probs, sampled)
            else:
                chains = batched_chains(
                    self.drafter, base_logits, hidden, [slot.last_token_ids[-1] for slot in drafted],
                    temperatures, [slot.seed for slot in drafted],
                    [slot.first_output_position for slot in drafted], self.config.max_support)
            for index, slot in enumerate(drafted):
                rows[slot.request_id] = self._proposal(slot, chains, index)
            self.timings.forward_s_total += forward_done_s - started_s
            self.timings.chains_s_total += time.perf_counter() - forward_done_s
        self.timings.num_proposals += 1
        self.timings.num_drafted_requests += sum(1 for proposal in rows.values() if proposal.token_ids)
        self.timings.propose_s_total += time.perf_counter() - proposed_s
        return DraftTokens(step_id=request.step_id, proposals=tuple(
            rows.get(slot.request_id) or DraftProposal(slot.request_id, (), (), ()) for slot in request.slots))

    # ------------------------------------------------------------------ helpers
    def _wants_drafts(self, slot: DraftSlot) -> bool:
        if not slot.last_token_ids:
            raise DraftSlotError(slot.request_id, "last_token_ids is empty: no seed token")
        if slot.temperature > 0 and (slot.seed is None or slot.first_output_position is None):
            raise DraftSlotError(slot.request_id, "a sampled slot needs seed and first_output_position")
        return self.speculation.enabled and slot.num_draft_tokens > 0

    def _contexts(self, slots: list[DraftSlot]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
        """Roll each ring back to its seed position -> (each ring's (main_x [c, D], positions [c]), seed positions)."""
        contexts, seed_positions = [], []
        for slot in slots:
            seed_position = slot.start_position + len(slot.last_token_ids) - 1
            self.rings.truncate(slot.request_id, seed_position)  # entries >= the seed are rejected drafts'
            contexts.append(self.rings.ring(slot.request_id).context())
            seed_positions.append(seed_position)
        return contexts, seed_positions

    def _padded_batch(self, contexts: list[tuple[torch.Tensor, torch.Tensor]], seed_token_ids: list[int],
                      seed_positions: list[int]) -> _Batch:
        """The eager forward's inputs: the contexts padded to the longest one."""
        num_blocks = len(contexts)
        num_context = max(features.shape[0] for features, _ in contexts)
        hidden_size = self.drafter.config.hidden_size
        main_x = torch.zeros(num_blocks, num_context, hidden_size, dtype=self.drafter.dtype, device=self.device)
        positions = torch.zeros(num_blocks, num_context, dtype=torch.long)
        valid = torch.zeros(num_blocks, num_context, dtype=torch.bool)
        for index, (features, context_positions) in enumerate(contexts):
            count = features.shape[0]
            main_x[index, :count] = features
            positions[index, :count] = context_positions
            valid[index, :count] = True
        seeds = torch.tensor(seed_token_ids, dtype=torch.long, device=self.device)
        offsets = torch.arange(self.drafter.dspark.block_size, dtype=torch.long)
        block_positions = torch.tensor(seed_positions, dtype=torch.long)[:, None] + offsets[None]  # [A, G]
        return _Batch(main_x, positions.to(self.device), valid.to(self.device), self.drafter.block_inputs(seeds),
                      block_positions.to(self.device), seed_positions)

    def _proposal(self, slot: DraftSlot, chains: RowChains, index: int) -> DraftProposal:
        """Row `index` of the batch's chains, cut to the width policy's choice and to slot.num_draft_tokens."""
        confidences = chains.confidences[index]
        width = min(choose_width(confidences, self.speculation), slot.num_draft_tokens)
        token_ids = tuple(chains.token_ids[index][:width])
        draft_probs = tuple(chains.chosen_probs[index][:width])
        support_ids = support_probs = ()
        if slot.temperature > 0 and self.config.draft_sampling == "greedy":  # q = all mass on each argmax draft
            support_ids = tuple((token,) for token in token_ids)
            support_probs = ((1.0,),) * width
            draft_probs = (1.0,) * width
        elif slot.temperature > 0:
            support_ids = tuple(chains.support_ids[index][:width])
            support_probs = tuple(chains.support_probs[index][:width])
        return DraftProposal(
            request_id=slot.request_id, token_ids=token_ids, draft_probs=draft_probs,
            confidences=tuple(confidences[:width]), support_token_ids=support_ids, support_probs=support_probs)


class DraftSlotError(ValueError):
    """A DraftSlot the drafter cannot serve (answered with ErrorReply(MALFORMED))."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"{request_id}: {reason}")
        self.request_id = request_id


