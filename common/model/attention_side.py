"""Everything of the model except the routed experts, with hub parameter names.

`AttentionSide.load_state_dict(hub_sd)` takes hub-named tensors directly (routed experts and
`mtp.*` excluded). The per-layer work is split into steps that an attention worker can call one
at a time, with the routed-expert dispatch between `gate` and `ffn_post`:

    h = embed(token_ids)
    for layer:  h = attn_block(layer, h, batch)
                x, post, comb = ffn_pre(layer, h)
                ids, weights = gate(layer, x, token_ids)
                h = ffn_post(layer, routed_answer(experts, layer, x, ids, weights), h, post, comb,
                             shared=shared_expert(layer, x))
    logits = logits(h)
`routed_answer` (moe.py) hands ffn_post an in-process holder's per-slot outputs [T, K, D], summed in
slot order inside hc_post's launch, or any other experts function's sum [T, D].
Legend: T tokens, N hc streams, D hidden, K top-k, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.common.model.attention import Attention
from moemesh.common.model.batch import ForwardBatch
from moemesh.common.model.config import ModelConfig, NumericsConfig
from moemesh.common.model.hyper import embed_streams, hc_head, hc_post, hc_post_with_mix, hc_pre
from moemesh.common.model.linear import Embedding, Linear, RMSNorm, assign_frozen, parameter
from moemesh.common.model.moe import Gate, SharedExpert
from moemesh.common.model.rope import RotaryTables


class FeedForwardSide(nn.Module):
    """`ffn.gate` and `ffn.shared_experts` (the routed `ffn.experts` live elsewhere)."""

    def __init__(self, config: ModelConfig, layer: int, numerics: NumericsConfig, *, dtype, device=None) -> None:
        super().__init__()
        self.gate = Gate(config, layer, dtype=dtype, device=device)
        self.shared_experts = SharedExpert(config, numerics, dtype=dtype, device=device)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, numerics: NumericsConfig, *, dtype, device=None) -> None:
        super().__init__()
        mix, width = config.num_hc_mix, config.hc_mult * config.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", parameter(mix, width, dtype=torch.float32, device=device))
            setattr(self, f"hc_{site}_base", parameter(mix, dtype=torch.float32, device=device))
            setattr(self, f"hc_{site}_scale", parameter(3, dtype=torch.float32, device=device))
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device)
        self.attn = Attention(config, layer, dtype=dtype, device=device, numerics=numerics)
        self.ffn = FeedForwardSide(config, layer, numerics, dtype=dtype, device=device)


class AttentionSide(nn.Module):
    def __init__(self, config: ModelConfig, numerics: NumericsConfig | None = None, *, device=None) -> None:
        super().__init__()
        self.config = config
        self.numerics = numerics or NumericsConfig()
        dtype = self.numerics.torch_dtype()
        self.dtype = dtype
        self.embed = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Block(config, layer, self.numerics, dtype=dtype, device=device) for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device)
        self.head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, device=device)
        self.hc_head_fn = parameter(config.hc_mult, config.hc_mult * config.hidden_size, dtype=torch.float32,
                                    device=device)
        self.hc_head_base = parameter(config.hc_mult, dtype=torch.float32, device=device)
        self.hc_head_scale = parameter(1, dtype=torch.float32, device=device)
        self._mix_partials = None  # from the last hc_post, for the hc_pre that reads its output

    @classmethod
    def from_state_dict(cls, config: ModelConfig, hub_sd: dict[str, torch.Tensor],
                        numerics: NumericsConfig | None = None, device: torch.device | str = "cpu") -> "AttentionSide":
        """Build without allocating twice: modules on the meta device, then the tensors assigned.

        hub_sd may also hold routed experts / mtp tensors; they are ignored. Tensors are cast to the
        parameter dtypes and moved to `device`."""
        if config.tie_word_embeddings and "head.weight" not in hub_sd:
            hub_sd = {**hub_sd, "head.weight": hub_sd["embed.weight"]}
        side = assign_frozen(cls(config, numerics, device="meta"), hub_sd, device, "attention-side")
        side.move_rope_tables(device)
        return side

    def move_rope_tables(self, device) -> None:
        """Put each attention's RoPE frequencies on `device` (they are built on the CPU), so that no
        host-to-device copy happens inside a forward (a CUDA-graph capture forbids them, and the decode
        kernels read them in place)."""
        for block in self.layers:
            block.attn.rope = block.attn.rope.to(device)

    # ----------------------------------------------------------------------------- steps
    def embed_tokens(self, token_ids: torch.Tensor, batch=None) -> torch.Tensor:
        """token_ids [T] -> streams h [T, N, D] (N identical copies of the embedding). Given the forward's batch
        (a ForwardBatch, or the static one of a captured step), also every RoPE kind's cos/sin of its positions,
        in one launch, for the layers to read."""
        if batch is not None:
            batch.set_rope(self._rotary_tables().cos_sin(batch.positions))
        first_fn = self.layers[0].hc_attn_fn if len(self.layers) else None
        h, self._mix_partials = embed_streams(token_ids, self.embed.weight, self.config.hc_mult, self.embed.dtype,
                                              first_fn)  # on CUDA the first hc_pre's mix GEMV in the same launch
        return h

    def _rotary_tables(self) -> RotaryTables:
        """The layers' RoPE kinds stacked (built on first use, again if the layers' tables were replaced)."""
        tables = tuple(block.attn.rope for block in self.layers)
        key = tuple((table.name, table.inv_freq.data_ptr()) for table in tables)
        if getattr(self, "_rotary_key", None) != key:
            self._rotary = RotaryTables.of(tables)
            self._rotary_key = key
        return self._rotary

    def _hc_pre(self, layer: int, site: str, h: torch.Tensor):
        """hc_pre of one site with the site's norm (attn_norm / ffn_norm) applied to x in the same launches,
        and its mix GEMV taken from the hc_post that wrote h when that one did it (`_post_and_mix`)."""
        block = self.layers[layer]
        c = self.config
        norm = getattr(block, f"{site}_norm")
        partials, self._mix_partials = self._mix_partials, None
        return hc_pre(h, getattr(block, f"hc_{site}_fn"), getattr(block, f"hc_{site}_base"),
                      getattr(block, f"hc_{site}_scale"), c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                      out_norm=(norm.weight, norm.eps), partials=partials)

    def _post_and_mix(self, next_layer: int, next_site: str, y: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor, y_addend: torch.Tensor | None = None) -> torch.Tensor:
        """hc_post whose launch also does the mix GEMV of the hc_pre that reads its result next (kept for
        that call: hc_pre uses it only for the same h and fn). No next hc_pre (the head): plain hc_post."""
        if next_layer >= len(self.layers):
            self._mix_partials = None
            return hc_post(y, h, post, comb, y_addend=y_addend)
        next_fn = getattr(self.layers[next_layer], f"hc_{next_site}_fn")
        out, self._mix_partials = hc_post_with_mix(y, h, post, comb, next_fn, y_addend=y_addend)
        return out

    def attn_block(self, layer: int, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """h [T, N, D] -> h [T, N, D]; updates the sequences' decode state for this layer."""
        block = self.layers[layer]
        x, post, comb = self._hc_pre(layer, "attn", h)  # x after attn_norm
        return self._post_and_mix(layer, "ffn", block.attn(x, batch), h, post, comb)

    def ffn_pre(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, N, D] -> (MoE input x [T, D] after ffn_norm, post [T, N], comb [T, N, N])."""
        return self._hc_pre(layer, "ffn", h)

    def gate(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], token_ids [T] -> ids [T, K] (ascending), weights [T, K]."""
        return self.layers[layer].ffn.gate(x, token_ids)

    def gates(self) -> dict[int, nn.Module]:
        """{layer: its MoE gate}, for an in-process expert holder to connect (`connect_gates`)."""
        return {layer: block.ffn.gate for layer, block in enumerate(self.layers)}

    def shared_expert(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].ffn.shared_experts(x)

    def ffn_post(self, layer: int, y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
        """y [T, D] = routed + shared (or y = routed and `shared` [T, D], added inside hc_post) -> h [T, N, D].
        y [T, K, D]: the routed experts' per-slot outputs, summed in slot order (`sum_slots_in_order`) inside
        hc_post before `shared` is added."""
        return self._post_and_mix(layer + 1, "attn", y, h, post, comb, y_addend=shared)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, N, D] -> normed [T, D] (input of the head)."""
        c = self.config
        y = hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps)
        return self.norm(y)

    def logits(self, h: torch.Tensor, token_indices: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, N, D] -> logits [T, V] (or only rows token_indices [B] -> [B, V])."""
        if token_indices is not None:
            h = h[token_indices]
        return self.head(self.final_hidden(h))
