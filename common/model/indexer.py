"""Lightning indexer of CSA layers (docs/model.md §2.6): picks which compressed rows each query attends to.

score I[t, w] = Σ_h w[t, h] · ReLU(q[t, h] · k_w) · d^-1/2 with w[t] = weights_proj(x_t) · H^-1/2,
over rows visible at t (w < (t+1) // m); keep the top min(index_topk, visible) rows.
The keys k_w come from the indexer's own overlapping compressor (row width d = index_head_dim); with the FP8 KV
QAT (`fp8_qat`, NumericsConfig.kv_fp8_qat) each key row is rounded as an FP8 indexer row stores it
(`qat.indexer_fp8_qat`: e4m3, one power-of-two scale per row) before it is stored.
`project_inputs` gives that compressor's inputs and the head weights w, one launch on CUDA at decode sizes.
Legend: T tokens, S tokens of one sequence, H indexer heads, d indexer head dim, N rows.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.common.model.compressor import Compressor, projection_kernel_applies
from moemesh.common.model.config import ModelConfig
from moemesh.common.model.linear import Linear
from moemesh.common.model.normed_linear import linear_norm_rope


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device=None, fp8_qat: bool = False) -> None:
        """fp8_qat: round every key row to the values of its FP8 row (docstring above)."""
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.ratio = config.csa_compress_ratio
        self.topk = config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.head_dim, dtype=dtype, device=device)
        self.weights_proj = Linear(config.hidden_size, self.num_heads, dtype=dtype, device=device)
        self.compressor = Compressor(config.hidden_size, self.head_dim, self.ratio, True, config.rms_norm_eps,
                                     dtype=dtype, device=device, fp8_qat_nope_dim=self.head_dim if fp8_qat else None,
                                     fp8_qat_block_size=self.head_dim)

    def project_queries(self, q_lat: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_lat [T, R], x [T, D] -> (queries [T, H, d] rotated at t, head weights [T, H] fp32)."""
        return self.rotated_queries(q_lat, cos, sin), self.head_weights(x)

    def rotated_queries(self, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_lat [T, R] -> queries [T, H, d] rotated at t."""
        queries = linear_norm_rope(self.wq_b, q_lat, group=self.head_dim, norm=False, cos=cos, sin=sin)  # [T, H·d]
        return queries.view(q_lat.shape[0], self.num_heads, self.head_dim)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> per-head score weights [T, H] fp32."""
        return self.weights_proj(x).float() * self.num_heads**-0.5

    def project_inputs(self, x: torch.Tensor, positions: torch.Tensor, layer_compressor: nn.Module | None = None
                       ) -> tuple[torch.Tensor, ...]:
        """x [T, D], positions [T] -> (compressor K [T, C], Z [T, C] fp32, head weights [T, H] fp32): everything
        the indexer projects from x; with the layer's own `layer_compressor` (CSA) its (K, Z) come first. One
        launch on CUDA at decode sizes (`common.kernels.projections`)."""
        compressor = self.compressor
        layer_linears = (layer_compressor.wkv, layer_compressor.wgate) if layer_compressor is not None else ()
        if projection_kernel_applies(x, positions, compressor.ape, compressor.wkv, compressor.wgate,
                                     self.weights_proj, *layer_linears):
            from moemesh.common.kernels.projections import compressor_projections

            own = (compressor.wkv.weight, compressor.wgate.weight, compressor.ape)
            if layer_compressor is None:
                return compressor_projections(x, *own, positions, head_weight=self.weights_proj.weight,
                                              head_scale=self.num_heads**-0.5)
            return compressor_projections(x, layer_compressor.wkv.weight, layer_compressor.wgate.weight,
                                          layer_compressor.ape, positions, second=own,
                                          head_weight=self.weights_proj.weight, head_scale=self.num_heads**-0.5)
        layer_inputs = layer_compressor.project(x, positions) if layer_compressor is not None else ()
        return (*layer_inputs, *compressor.project(x, positions), self.head_weights(x))

    def scores(self, queries: torch.Tensor, head_weights: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """queries [S, H, d], head_weights [S, H], rows [N, d] (decoded), positions [S] -> scores [S, N] fp32,
        -inf where a row is not visible yet."""
        num_rows = rows.shape[0]
        visible = torch.arange(num_rows, device=rows.device)[None, :] < ((positions + 1) // self.ratio)[:, None]
        logits = torch.einsum("shd,nd->shn", queries.float(), rows.float())  # [S, H, N]
        logits = torch.relu(logits) * self.head_dim**-0.5
        scores = (logits * head_weights.unsqueeze(-1)).sum(dim=1)  # [S, N]
        return scores.masked_fill(~visible, float("-inf"))

    def select(self, queries: torch.Tensor, head_weights: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """queries [S, H, d], head_weights [S, H], rows [N, d], positions [S] -> selected [S, N] bool."""
        num_rows = rows.shape[0]
        visible = torch.arange(num_rows, device=rows.device)[None, :] < ((positions + 1) // self.ratio)[:, None]
        num_keep = min(self.topk, num_rows)
        if num_keep == 0:
            return visible
        scores = self.scores(queries, head_weights, rows, positions)  # [S, N]
        top = scores.topk(num_keep, dim=-1).indices  # [S, k]; invisible picks removed below
        selected = torch.zeros_like(visible).scatter_(1, top, True)
        return selected & visible
