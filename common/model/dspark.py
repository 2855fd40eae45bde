"""The DSpark drafter (docs/speculation.md §2-3): three window-only V4 blocks over a ring of target features.

Structure, with hub names (everything under `mtp.{j}.`, j = 0..num_stages-1):
- `mtp.0.main_proj` [D, L·D] and `mtp.0.main_norm`: the target's hidden states after the
  `dspark_target_layer_ids` layers, each averaged over its HC streams and concatenated (L·D floats
  per position), are fused into one context feature `main_x` [D] per past position.
- every stage is an ordinary window-only, learned-router V4 block: the parameters of
  `common.model.attention_side.Block` (same names as a main layer), built from the model core.
  Its attention sees (a) the context ring: this stage's own `wkv` + `kv_norm` of `main_x`,
  rotated at the context positions, and (b) the γ block positions, bidirectionally. Queries are
  the block positions only. The main window rule is not applied: the ring is at most
  `sliding_window` entries and every entry plus every block slot is visible to every slot.
- routed experts: each stage is a normal MoE layer. Its routed experts are stored as
  `mtp.{j}.ffn.experts.{e}.w{1,2,3}` (FP4 like the main experts) and computed through the model
  core's `RoutedExperts`, keyed `(j, e)`: the `layer` argument of the `ExpertsFn` seam is the
  stage index j. The draft worker holds them itself (they never go to an expert worker, so the
  drafter needs no network hop per stage).
- last stage extras: `hc_head_{fn,base,scale}`, `norm`, the Markov head
  (`markov_head.markov_w1` [V, r] embedding, `markov_head.markov_w2` r -> V) and the confidence
  head (`confidence_head.proj` [1, D + r], no bias).
- the target's `embed` and `head` are shared and frozen: held by reference, not registered, so
  they never appear under `mtp.*`.

Slots: the block input is [seed, MASK × (γ-1)] at positions seed_position + 0..γ-1; slot k
(0-based) predicts the token at seed_position + k + 1. The context ring holds features of
positions before seed_position (the seed itself has not been through the target yet).
Legend: A blocks (anchors), G = γ slots, C context positions, D hidden, N hc streams,
V vocab, r Markov rank, H heads, hd head dim, F = L·D fused feature width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.model.attention import Attention, attend_with_sink
from moemesh.common.model.attention_side import Block
from moemesh.common.model.config import AttentionKind, ModelConfig, NumericsConfig, RouterKind
from moemesh.common.model.hyper import hc_head, hc_post, hc_pre
from moemesh.common.model.linear import Embedding, Linear, RMSNorm, assign_frozen, parameter
from moemesh.common.model.moe import ExpertsFn, RoutedExperts
from moemesh.common.model.rope import inverse_rope, rms_norm_rope

NUM_DSPARK_STAGES = 3
MTP_PREFIX = "mtp."


def stage_block_config(config: ModelConfig) -> ModelConfig:
    """A one-layer config whose layer 0 is a window-only, learned-router block: what each DSpark
    stage is (compress ratio 0, router with bias). Lets the stages reuse `Block` unchanged."""
    return dataclasses.replace(
        config, num_hidden_layers=1, layer_types=(AttentionKind.WINDOW,), mlp_layer_types=(RouterKind.LEARNED,),
        dspark=None, extra_compress_ratios=(), num_nextn_predict_layers=0,
    )


class MarkovHead(nn.Module):
    """Low-rank bigram bias: bias(prev) = W2 · W1[prev]  (W1 [V, r] embedding, W2 [V, r] = r -> V)."""

    def __init__(self, vocab_size: int, rank: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.markov_w1 = Embedding(vocab_size, rank, dtype=dtype, device=device)
        self.markov_w2 = Linear(rank, vocab_size, dtype=dtype, device=device)

    def forward(self, prev_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_token_ids [...] -> (bias [..., V], embedding W1[prev] [..., r])."""
        embedding = self.markov_w1(prev_token_ids)
        return self.markov_w2(embedding), embedding


class ConfidenceHead(nn.Module):
    """c = σ(w · [h ; W1[prev]]): probability that the slot's draft survives verification given
    that every earlier slot did (trained towards 1 - TV(p_d, p_t))."""

    def __init__(self, hidden_size: int, rank: int, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.proj = Linear(hidden_size + rank, 1, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] (pre-norm), markov_embedding [..., r] -> confidence [...] in (0, 1)."""
        features = torch.cat([hidden, markov_embedding.to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.proj(features).float()).squeeze(-1)


class DSparkStage(Block):
    """`mtp.{j}`: a window-only learned-router V4 block plus the stage-0 / last-stage extras."""

    def __init__(self, config: ModelConfig, stage: int, num_stages: int, numerics: NumericsConfig, *,
                 dtype: torch.dtype, device=None) -> None:
        super().__init__(stage_block_config(config), 0, numerics, dtype=dtype, device=device)
        dspark = config.dspark
        hidden = config.hidden_size
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if self.is_first:
            self.main_proj = Linear(len(dspark.target_layer_ids) * hidden, hidden, dtype=dtype, device=device)
            self.main_norm = RMSNorm(hidden, config.rms_norm_eps, device=device)
        if self.is_last:
            self.norm = RMSNorm(hidden, config.rms_norm_eps, device=device)
            self.hc_head_fn = parameter(config.hc_mult, config.hc_mult * hidden, dtype=torch.float32, device=device)
            self.hc_head_base = parameter(config.hc_mult, dtype=torch.float32, device=device)
            self.hc_head_scale = parameter(1, dtype=torch.float32, device=device)
            self.markov_head = MarkovHead(config.vocab_size, dspark.markov_rank, dtype=dtype, device=device)
            self.confidence_head = ConfidenceHead(hidden, dspark.markov_rank, dtype=dtype, device=device)


@dataclass(frozen=True)
class DraftChain:
    """One drafted block: tokens [G] int64, the exact draft distribution each was drawn from
    (probs [G, V] fp32, rows sum to 1; needed by lossless rejection), confidences [G] in (0, 1)."""

    token_ids: torch.Tensor
    probs: torch.Tensor
    confidences: torch.Tensor

    def prefix_survival(self) -> torch.Tensor:
        """S_k = Π_{j<=k} c_j -> [G] (what the scheduler ranks candidates by)."""
        return torch.cumprod(self.confidences, dim=0)


def _attend_blocks(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """`attend_with_sink` mapped over blocks: q [A, G, H, hd], keys [A, L, hd], visible [A, G, L]."""
    return torch.vmap(attend_with_sink, in_dims=(0, 0, 0, None, None))(q, keys, visible, sink, scale)


class DSparkDrafter(nn.Module):
    """The drafter's own weights (`mtp.*`) plus references to the target's embed and head."""

    def __init__(self, config: ModelConfig, embed: Embedding, head: Linear, numerics: NumericsConfig | None = None,
                 *, device=None) -> None:
        super().__init__()
        if config.dspark is None:
            raise ValueError("config has no dspark_* keys: not a DSpark checkpoint")
        self.config = config
        self.dspark = config.dspark
        self.numerics = numerics or NumericsConfig()
        self.dtype = self.numerics.torch_dtype()
        num_stages = config.num_nextn_predict_layers
        if num_stages < 1:
            raise ValueError(f"num_nextn_predict_layers={num_stages}: DSpark needs at least one stage")
        self.mtp = nn.ModuleList(
            DSparkStage(config, j, num_stages, self.numerics, dtype=self.dtype, device=device) for j in range(num_stages)
        )
        self._shared = (embed, head)  # a tuple: not registered, so not in state_dict / parameters()
        self.experts_fn: ExpertsFn | None = None

    def set_experts(self, experts_fn: ExpertsFn) -> None:
        """The routed experts of the stages (`experts_fn(stage, x, ids, weights)`). Stored without
        nn.Module registration even when it is a module, so `state_dict()` stays the hub `mtp.*`
        names of the stage weights."""
        object.__setattr__(self, "experts_fn", experts_fn)

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_state_dict(cls, config: ModelConfig, hub_sd: dict[str, torch.Tensor], embed: Embedding, head: Linear,
                        numerics: NumericsConfig | None = None, device: torch.device | str = "cpu") -> "DSparkDrafter":
        """hub_sd: `mtp.*` tensors (hub names, e.g. from `CheckpointReader.load_mtp`), routed experts
        included; other names are ignored. Weights frozen, on `device`."""
        drafter = assign_frozen(cls(config, embed, head, numerics, device="meta"), hub_sd, device, "drafter")
        weights = {}
        for j in range(len(drafter.mtp)):
            for expert in range(config.n_routed_experts):
                prefix = f"{MTP_PREFIX}{j}.ffn.experts.{expert}."
                weights[(j, expert)] = tuple(hub_sd[prefix + f"{w}.weight"].to(device=device, dtype=drafter.dtype)
                                             for w in ("w1", "w2", "w3"))
        drafter.set_experts(RoutedExperts.from_config(weights, config, drafter.numerics))
        return drafter

    @property
    def embed(self) -> Embedding:
        return self._shared[0]

    @property
    def head(self) -> Linear:
        return self._shared[1]

    # ----------------------------------------------------------------------------- forward
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F] (target layers' stream-averaged hidden states, concatenated) -> main_x [..., D]."""
        first = self.mtp[0]
        return first.main_norm(first.main_proj(features.to(self.dtype)))

    def _stage_attention(self, attn: Attention, x: torch.Tensor, main_x: torch.Tensor, context_positions: torch.Tensor,
                         context_valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [A·G, D] (after attn_norm), main_x [A, C, D] -> [A·G, D]. Same math as `Attention.forward`
        (query low rank, per-head RMS, interleaved RoPE, K = V latent, sink, de-rotation, grouped output),
        over context ring ∪ block keys. Norm + RoPE and the de-rotation go through the fused glue
        (`rms_norm_rope`, `inverse_rope`: one launch each on CUDA, the two-step torch code elsewhere)."""
        num_blocks, num_slots = positions.shape
        num_context = main_x.shape[1]
        eps = self.config.rms_norm_eps
        cos, sin = attn.rope.cos_sin(positions.reshape(-1))
        q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(num_blocks * num_slots, attn.num_heads, attn.head_dim)
        q = rms_norm_rope(q, cos, sin, eps)  # per-head unweighted norm, then RoPE: [A·G, H, hd]
        kv_norm_eps, kv_norm_weight = attn.kv_norm.eps, attn.kv_norm.weight
        block_kv = rms_norm_rope(attn.wkv(x), cos, sin, kv_norm_eps, weight=kv_norm_weight
                                 ).view(num_blocks, num_slots, -1)  # [A, G, hd]
        context_cos, context_sin = attn.rope.cos_sin(context_positions.reshape(-1).clamp_min(0))
        context_kv = rms_norm_rope(attn.wkv(main_x.reshape(num_blocks * num_context, main_x.shape[-1])),
                                   context_cos, context_sin, kv_norm_eps, weight=kv_norm_weight
                                   ).view(num_blocks, num_context, attn.head_dim)  # [A, C, hd]
        keys = torch.cat([context_kv, block_kv.to(context_kv.dtype)], dim=1)  # [A, C + G, hd]
        visible = torch.cat([context_valid[:, None, :].expand(-1, num_slots, -1),
                             torch.ones(num_blocks, num_slots, num_slots, dtype=torch.bool, device=x.device)], dim=-1)
        out = _attend_blocks(q.view(num_blocks, num_slots, attn.num_heads, -1), keys, visible, attn.attn_sink,
                             attn.scale).reshape(num_blocks * num_slots, attn.num_heads, -1)
        out = inverse_rope(out, cos, sin)  # values carried rotated dims: rotate back at the query position
        grouped = out.reshape(num_blocks * num_slots, self.config.o_groups, -1)  # [A·G, groups, H/groups·hd]
        return attn.wo_b(attn.wo_a(grouped))

    def block_hidden(self, main_x: torch.Tensor, context_positions: torch.Tensor, context_valid: torch.Tensor,
                     block_token_ids: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """Run the stages over A blocks at once.

        main_x [A, C, D]; context_positions [A, C] int; context_valid [A, C] bool (False = no such
        position, e.g. before the start of the sequence); block_token_ids / block_positions [A, G].
        Returns the pre-norm hidden state of every slot [A, G, D] (after the last stage's hc_head).
        Each site's hc_pre and its block norm run as one `hc_pre(..., out_norm=)` (the norm inside hc_pre's finish
        launch on CUDA). The final hc_head stays unfused: the confidence head needs its pre-norm
        output, and `base_logits` applies the norm.
        """
        if self.experts_fn is None:
            raise RuntimeError("DSparkDrafter.experts_fn is not set (routed experts of the mtp.* stages)")
        c = self.config
        num_blocks, num_slots = block_token_ids.shape
        flat_ids = block_token_ids.reshape(-1)  # [A·G]
        e = self.embed(flat_ids)
        h = e.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [A·G, N, D]
        for j, stage in enumerate(self.mtp):
            x, post, comb = hc_pre(h, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale, c.hc_sinkhorn_iters,
                                   c.hc_eps, c.rms_norm_eps, out_norm=(stage.attn_norm.weight, stage.attn_norm.eps))
            y = self._stage_attention(stage.attn, x, main_x, context_positions, context_valid, block_positions)
            h = hc_post(y, h, post, comb)
            x, post, comb = hc_pre(h, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale, c.hc_sinkhorn_iters,
                                   c.hc_eps, c.rms_norm_eps, out_norm=(stage.ffn_norm.weight, stage.ffn_norm.eps))
            ids, weights = stage.ffn.gate(x, flat_ids)
            y = self.experts_fn(j, x, ids, weights) + stage.ffn.shared_experts(x)
            h = hc_post(y, h, post, comb)
        last = self.mtp[-1]
        hidden = hc_head(h, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, c.hc_eps, c.rms_norm_eps)
        return hidden.view(num_blocks, num_slots, -1)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., D] -> U [..., V] through the last stage's norm and the target's head."""
        return self.head(self.mtp[-1].norm(hidden))

    def block_inputs(self, seed_token_ids: torch.Tensor) -> torch.Tensor:
        """seed ids [A] -> [A, G]: the seed followed by G-1 mask tokens."""
        masks = torch.full((seed_token_ids.shape[0], self.dspark.block_size - 1), self.dspark.noise_token_id,
                           dtype=torch.long, device=seed_token_ids.device)
        return torch.cat([seed_token_ids.long()[:, None], masks], dim=1)

    @torch.no_grad()
    def propose(self, context_features: torch.Tensor, context_positions: torch.Tensor, seed_token_id: int,
                seed_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's draft step (docs/speculation.md §3.3 steps 2-3).

        context_features [C, F]: the ring (C <= sliding_window) of fused-layer features of positions
        context_positions [C] (all < seed_position). Returns (base logits U [G, V], pre-norm hidden
        [G, D]); feed them to `greedy_chain` or `sampled_chain`.
        """
        device = self.head.weight.device
        main_x = self.fuse_features(context_features.to(device))[None]  # [1, C, D]
        positions = torch.as_tensor(context_positions, device=device).long()[None]
        valid = torch.ones_like(positions, dtype=torch.bool)
        seed = torch.tensor([seed_token_id], device=device)
        block_positions = seed_position + torch.arange(self.dspark.block_size, device=device)[None]
        hidden = self.block_hidden(main_x, positions, valid, self.block_inputs(seed), block_positions)[0]
        return self.base_logits(hidden), hidden

    # ----------------------------------------------------------------------------- Markov chains
    def markov_logits(self, base_logits: torch.Tensor, prev_token_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """U [..., V] + W2 W1[prev] -> (draft logits [..., V] fp32, W1[prev] [..., r])."""
        bias, embedding = self.mtp[-1].markov_head(prev_token_ids)
        return base_logits.float() + bias.float(), embedding

    def confidence(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        return self.mtp[-1].confidence_head(hidden, markov_embedding)

    @torch.no_grad()
    def greedy_chain(self, base_logits: torch.Tensor, hidden: torch.Tensor, seed_token_id: int) -> DraftChain:
        """x_k = argmax(U_k + W1[x_{k-1}] W2), x_0 = seed. probs are the softmax at temperature 1."""
        return self._chain(base_logits, hidden, seed_token_id, lambda k, logits: int(logits.argmax()), 1.0)

    @torch.no_grad()
    def sampled_chain(self, base_logits: torch.Tensor, hidden: torch.Tensor, seed_token_id: int, *,
                      temperature: float, seed: int, output_positions: Sequence[int]) -> DraftChain:
        """Probabilistic drafting: x_k ~ softmax((U_k + W1[x_{k-1}] W2) / temperature), each draw from
        its own stream `stream(seed, Purpose.DRAFT, output_positions[k])` (independent of the
        verifier's streams, docs/speculation.md §6.5). probs are exactly the distributions sampled from."""
        from moemesh.common.sampling.draw import sample_from_probs
        from moemesh.common.sampling.rng import Purpose, stream

        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (use greedy_chain for argmax drafting)")
        if len(output_positions) != base_logits.shape[0]:
            raise ValueError(f"{len(output_positions)} output positions for {base_logits.shape[0]} slots")
        device = base_logits.device

        def choose(k: int, probs: torch.Tensor) -> int:
            generator = stream(seed, Purpose.DRAFT, int(output_positions[k]), device)
            return int(sample_from_probs(probs[None], [generator])[0])

        return self._chain(base_logits, hidden, seed_token_id, choose, temperature, pass_probs=True)

    def _chain(self, base_logits, hidden, seed_token_id: int, choose, temperature: float, *,
               pass_probs: bool = False) -> DraftChain:
        num_slots = base_logits.shape[0]
        device = base_logits.device
        token_ids = torch.empty(num_slots, dtype=torch.long, device=device)
        probs = torch.empty(num_slots, base_logits.shape[1], dtype=torch.float32, device=device)
        confidences = torch.empty(num_slots, dtype=torch.float32, device=device)
        prev = torch.tensor(seed_token_id, device=device)
        for k in range(num_slots):  # left to right: each choice conditions the next slot's bias
            logits, embedding = self.markov_logits(base_logits[k], prev)
            probs[k] = torch.softmax(logits / temperature, dim=-1)
            confidences[k] = self.confidence(hidden[k], embedding)
            token = choose(k, probs[k] if pass_probs else logits)
            token_ids[k] = token
            prev = torch.tensor(token, device=device)
        return DraftChain(token_ids, probs, confidences)


def target_features(hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fused-feature input of one position set: each [T, N, D] HC state averaged over its
    streams, concatenated in `dspark_target_layer_ids` order -> [T, L·D]."""
    return torch.cat([h.mean(dim=1) for h in hidden_states], dim=-1)


def dspark_loss_terms(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                      confidences: torch.Tensor, slot_weights: torch.Tensor
                      ) -> dict[str, torch.Tensor]:
    """DSpark training loss (docs/speculation.md §2.5): 0.1·CE + 0.9·TV(p_d, p_t) + 1.0·BCE(c, 1 - TV).

    draft_logits / target_logits [A, G, V]; labels [A, G] int (the data token each slot predicts);
    confidences [A, G]; slot_weights [A, G] = exp(-k/γ) (k 0-based) times a validity mask.
    The BCE target 1 - TV is detached (the confidence head learns to predict it, it does not pull
    the drafter). Returns the weighted means: {"loss", "ce", "tv", "bce"}.
    """
    log_p_draft = F.log_softmax(draft_logits.float(), dim=-1)
    p_target = torch.softmax(target_logits.float(), dim=-1)
    ce = -log_p_draft.gather(-1, labels.long()[..., None]).squeeze(-1)  # [A, G]
    tv = 0.5 * (log_p_draft.exp() - p_target).abs().sum(dim=-1)  # [A, G] in [0, 1]
    survival = (1.0 - tv).detach()
    c = confidences.float().clamp(1e-6, 1 - 1e-6)
    bce = -(survival * c.log() + (1 - survival) * (1 - c).log())  # [A, G]; written out: autocast-safe
    total_weight = slot_weights.sum().clamp_min(1e-6)

    def mean(values: torch.Tensor) -> torch.Tensor:
        return (values * slot_weights).sum() / total_weight

    terms = {"ce": mean(ce), "tv": mean(tv), "bce": mean(bce)}
    terms["loss"] = 0.1 * terms["ce"] + 0.9 * terms["tv"] + 1.0 * terms["bce"]
    return terms


def slot_weights(block_size: int, device=None) -> torch.Tensor:
    """exp(-(k-1)/γ) for 1-based slot k -> [G]."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / block_size)
