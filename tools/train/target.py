"""The target model in training form: the model core's `AttentionSide` with trainable parameters,
plus the routed experts as stacked parameters fed through the core's `RoutedExperts`.

The training forward is the same layer loop as `ReferenceModel.forward`, without inference mode so
autograd records it, over B windows of S tokens from position 0. Attention runs either through the
core's `AttentionSide.attn_block` (one `ForwardBatch`, a fresh `SequenceState` per window: the core
loops over windows) or, by default, through `tools.train.batched_attention`, which computes the
same from the same modules for all windows at once (tested equal to the core path).
Legend: B windows, S tokens per window, T = B·S, N hc streams, D hidden, E experts, I expert width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.common.model.config import ModelConfig, NumericsConfig, RouterKind
from moemesh.common.model.hyper import hc_post
from moemesh.common.model.moe import RoutedExperts, _swiglu
from moemesh.common.model.state import SequenceState
from moemesh.tools.train.batched_attention import batched_attention


def init_parameters(module: nn.Module, config: ModelConfig, generator: torch.Generator) -> None:
    """Fan-in scaled normal linears (output projections shrunk by depth), unit norms, zero HC
    base / sink / ape / bias, HC fn std 0.02 and scale 1 (so streams start evenly mixed), a zero
    Markov projection (the DSpark bigram bias starts as a no-op)."""
    depth_scale = (2 * config.num_hidden_layers) ** -0.5
    for name, tensor in module.named_parameters():
        with torch.no_grad():
            if name == "embed.weight":
                tensor.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif "hc_" in name and name.endswith("_fn"):
                tensor.normal_(0.0, 0.02, generator=generator)
            elif "hc_" in name and name.endswith("_scale"):
                tensor.fill_(1.0)
            elif name.endswith(("_base", "attn_sink", ".ape", "gate.bias", "markov_w2.weight")):
                tensor.zero_()
            elif tensor.dim() == 2:
                std = tensor.shape[1] ** -0.5
                if name.endswith(("wo_b.weight", "shared_experts.w2.weight")):
                    std *= depth_scale
                tensor.normal_(0.0, std, generator=generator)
            else:
                raise AssertionError(f"no initialisation rule for {name} {tuple(tensor.shape)}")


def _init_side(side: AttentionSide, config: ModelConfig, generator: torch.Generator) -> None:
    """`init_parameters`, plus random distinct experts per token in `tid2eid`."""
    init_parameters(side, config, generator)
    for layer, kind in enumerate(config.mlp_layer_types):
        if kind is RouterKind.HASH:
            table = side.layers[layer].ffn.gate.tid2eid
            rows = [torch.randperm(config.n_routed_experts, generator=generator)[: config.num_experts_per_tok]
                    for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


class StackedExperts(nn.Module):
    """Routed experts of several layers (or drafter stages) as [E, ...] parameters per layer.

    Calling it is the `ExpertsFn` seam: it builds the core's `RoutedExperts` over views of the
    parameters (views carry gradients) and counts the tokens each expert received, for the
    routers' bias balancing.
    """

    def __init__(self, num_layers: int, config: ModelConfig, generator: torch.Generator, device) -> None:
        super().__init__()
        e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        depth_scale = (2 * config.num_hidden_layers) ** -0.5

        def make(shape, std):
            return nn.Parameter((torch.randn(shape, generator=generator) * std).to(device))

        self.w1 = nn.ParameterList(make((e, i, d), d**-0.5) for _ in range(num_layers))
        self.w2 = nn.ParameterList(make((e, d, i), i**-0.5 * depth_scale) for _ in range(num_layers))
        self.w3 = nn.ParameterList(make((e, i, d), d**-0.5) for _ in range(num_layers))
        self.config = config
        self.swiglu_limit = config.swiglu_limit
        self.counts = [torch.zeros(e, device=device) for _ in range(num_layers)]
        self.dense = True  # False: the model core's RoutedExperts (a host sync per expert, same math)

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_experts = self.config.n_routed_experts
        flat_ids = ids.reshape(-1)
        self.counts[layer].index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=self.counts[layer].dtype))
        if self.dense:
            return dense_routed_experts(x, ids, weights, self.w1[layer], self.w2[layer], self.w3[layer],
                                        self.swiglu_limit)
        held = {(layer, e): (self.w1[layer][e], self.w2[layer][e], self.w3[layer][e]) for e in range(num_experts)}
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # one dtype inside RoutedExperts' scatter
            x = x.to(torch.get_autocast_dtype(device_type))
        return RoutedExperts(held, self.swiglu_limit)(layer, x, ids, weights)

    def reset_counts(self) -> list[torch.Tensor]:
        counts = [c.clone() for c in self.counts]
        for c in self.counts:
            c.zero_()
        return counts

    def hub_state_dict(self, prefix_of_layer) -> dict[str, torch.Tensor]:
        """{prefix_of_layer(l) + f"ffn.experts.{e}.w1.weight": [I, D], ...} detached float tensors."""
        out = {}
        for layer in range(len(self.w1)):
            for e in range(self.config.n_routed_experts):
                prefix = f"{prefix_of_layer(layer)}ffn.experts.{e}."
                out[prefix + "w1.weight"] = self.w1[layer][e].detach()
                out[prefix + "w2.weight"] = self.w2[layer][e].detach()
                out[prefix + "w3.weight"] = self.w3[layer][e].detach()
        return out


def dense_routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """The routed sum of `RoutedExperts` with every expert run on every token: x [T, D], ids /
    weights [T, K], w1 / w3 [E, I, D], w2 [E, D, I] -> [T, D].

    Three GEMMs over all E experts at once, the route weight (zero for unselected experts) applied
    before w2 (the same sum: w2 is linear). E/K times the expert FLOPs of a gathered dispatch, but
    fixed shapes and no host synchronisation (the gathered path reads the ids on the host to slice
    per expert), which is what bounds a small model's training step on a GPU."""
    num_tokens = x.shape[0]
    num_experts, width, hidden = w1.shape
    combine = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, ids, weights.float())  # [T, E]
    gate = F.linear(x, w1.reshape(num_experts * width, hidden)).view(num_tokens, num_experts, width)
    up = F.linear(x, w3.reshape(num_experts * width, hidden)).view(num_tokens, num_experts, width)
    act = _swiglu(gate, up, swiglu_limit) * combine.unsqueeze(-1).to(gate.dtype)  # [T, E, I]
    w2_flat = w2.permute(1, 0, 2).reshape(hidden, num_experts * width)  # [D, E·I]
    return F.linear(act.reshape(num_tokens, num_experts * width), w2_flat)


def balance_router_biases(gates, counts: list[torch.Tensor], rate: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3 style): raise the selection bias of experts that
    got fewer tokens than the mean, lower it for those that got more. Hash layers have no bias."""
    with torch.no_grad():
        for gate, count in zip(gates, counts):
            if getattr(gate, "bias", None) is None:
                continue
            gate.bias += rate * torch.sign(count.mean() - count)  # all zero when no token was counted


class TrainableTarget(nn.Module):
    def __init__(self, config: ModelConfig, seed: int, device: torch.device | str) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.config = config
        self.side = AttentionSide(config, NumericsConfig("float32"), device="cpu")
        _init_side(self.side, config, generator)
        self.experts = StackedExperts(config.num_hidden_layers, config, generator, "cpu")
        self.to(device)
        self.experts.counts = [c.to(device) for c in self.experts.counts]
        for name, param in self.named_parameters():
            param.requires_grad_(not name.endswith("gate.bias"))  # the bias moves by balancing only

    @property
    def gates(self):
        return [block.ffn.gate for block in self.side.layers]

    def forward_streams(self, token_ids: torch.Tensor, capture_layers: tuple[int, ...] = (), *,
                        batched: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """token_ids [B, S] -> (final streams h [B·S, N, D], [h after each capture layer [B·S, N, D]]).

        batched=True: attention through `batched_attention` (all windows in a few kernels);
        False: the core's per-sequence `AttentionSide.attn_block` with fresh decode states."""
        side = self.side
        num_windows, seq_len = token_ids.shape
        batch = None
        if not batched:
            states = [SequenceState(self.config, dtype=side.dtype, device=token_ids.device) for _ in range(num_windows)]
            batch = ForwardBatch([SequenceChunk(state, seq_len) for state in states], token_ids.device)
        flat_ids = token_ids.reshape(-1)
        h = side.embed_tokens(flat_ids)  # [T, N, D]
        captured = []
        for layer in range(self.config.num_hidden_layers):
            if batched:
                block = side.layers[layer]
                x, post, comb = side._hc_pre(layer, "attn", h)
                h = hc_post(batched_attention(block.attn, block.attn_norm(x), num_windows), h, post, comb)
            else:
                h = side.attn_block(layer, h, batch)
            x, post, comb = side.ffn_pre(layer, h)
            ids, weights = side.gate(layer, x, flat_ids)
            y = self.experts(layer, x, ids, weights) + side.shared_expert(layer, x)
            h = side.ffn_post(layer, y, h, post, comb)
            if layer in capture_layers:
                captured.append(h)
        if batch is not None:
            batch.finish()
        return h, captured

    def logits_from_streams(self, h: torch.Tensor) -> torch.Tensor:
        return self.side.head(self.side.final_hidden(h))

    def hub_state_dict(self) -> dict[str, torch.Tensor]:
        """Hub-named float tensors of the whole target (attention side + routed experts)."""
        out = {name: t.detach() for name, t in self.side.state_dict().items()}
        out.update(self.experts.hub_state_dict(lambda layer: f"layers.{layer}."))
        return out


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V], targets [T], weights [T] 0/1 -> (mean loss over weighted tokens, token count)."""
    losses = torch.nn.functional.cross_entropy(logits.float(), targets.long(), reduction="none")
    count = weights.sum()
    return (losses * weights).sum() / count.clamp_min(1.0), count


def cosine_lr(step: int, total_steps: int, warmup_steps: int, peak: float, floor_fraction: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor_fraction · peak at total_steps."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak * (floor_fraction + (1 - floor_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))
