"""DeepSeek-V4 attention (docs/model.md §2.3, §2.7): one latent K = V head, sinks, window ∪ compressed rows.

Per token t (all projections batched over the T tokens of the forward):
  q_lat = q_norm(wq_a x) -> q = wq_b q_lat [H, hd], per-head unweighted RMS, RoPE on the tail;
  kv = kv_norm(wkv x) [hd], RoPE on the tail (with `kv_fp8_qat`, FP8 quant-dequant of the first
  nope_head_dim channels, docs/model.md §2.3); this row enters the window ring.
Keys/values for t: raw rows of positions t-W+1..t, plus compressed rows: HCA all closed windows
(w < (t+1)//m), CSA the indexer's top-k among those. Softmax has a per-head sink (an extra logit
with no value). Values carry rotated dims, so the output tail is rotated back by -θ(t). The output
projection is grouped: heads in G groups, wo_a per group, then wo_b.
Two paths compute the same core: batched Triton kernels over every sequence at once when the
ForwardBatch carries address tables (CUDA by default, `common/model/attention_kernels.py`), and
the per-sequence torch loop below (CPU, MOEMESH_TORCH_ATTENTION=1, autograd), the reference.
Legend: T tokens, S tokens of one sequence, H heads, hd head dim, L keys, G groups, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.common.model.batch import ForwardBatch
from moemesh.common.model.compressor import Compressor
from moemesh.common.model.config import AttentionKind, ModelConfig, NumericsConfig
from moemesh.common.model.indexer import Indexer
from moemesh.common.model.linear import GroupedLinear, Linear, RMSNorm, parameter
from moemesh.common.model.qat import kv_nope_fp8_qat
from moemesh.common.model.normed_linear import linear_norm_rope
from moemesh.common.model.rope import RotaryTable, inverse_rope
from moemesh.common.model.state import LayerState


def batched_attention_core(*args, **kwargs):  # imports triton: only when the kernels run
    from moemesh.common.model.attention_kernels import batched_attention_core as core

    return core(*args, **kwargs)


def can_use_kernels(batch: ForwardBatch, kv: torch.Tensor) -> bool:
    if batch.attention_tables is None:
        return False
    from moemesh.common.model.attention_kernels import can_use_kernels as check

    return check(batch, kv)


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [S, H, hd], keys [L, hd] (= values), visible [S, L] bool, sink [H] -> [S, H, hd]."""
    logits = torch.einsum("shd,ld->shl", q, keys) * scale  # [S, H, L]
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink_logits = sink.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink_logits], dim=-1), dim=-1)[..., :-1]  # drop the sink
    return torch.einsum("shl,ld->shd", probs.to(keys.dtype), keys)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device=None,
                 numerics: NumericsConfig | None = None) -> None:
        super().__init__()
        c = config
        numerics = numerics or NumericsConfig()
        # leading kv channels FP8-simulated (reference QAT); None = rows stay in the activation dtype
        self.fp8_qat_nope_dim = c.nope_head_dim if numerics.kv_fp8_qat else None
        self.config = c
        self.layer = layer
        self.kind = c.layer_types[layer]
        self.num_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.scale = c.head_dim**-0.5
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype=dtype, device=device)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, device=device)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, dtype=dtype, device=device)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype=dtype, device=device)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device=device)
        heads_per_group = c.num_attention_heads // c.o_groups
        self.wo_a = GroupedLinear(heads_per_group * c.head_dim, c.o_groups * c.o_lora_rank, c.o_groups,
                                  dtype=dtype, device=device)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, dtype=dtype, device=device)
        self.attn_sink = parameter(c.num_attention_heads, dtype=torch.float32, device=device)
        ratio = c.compress_ratio(layer)
        self.compressor = None
        self.indexer = None
        if self.kind is AttentionKind.CSA:
            self.compressor = Compressor(c.hidden_size, c.head_dim, ratio, True, c.rms_norm_eps,
                                         dtype=dtype, device=device, fp8_qat_nope_dim=self.fp8_qat_nope_dim)
            self.indexer = Indexer(c, dtype=dtype, device=device, fp8_qat=numerics.kv_fp8_qat)
        elif self.kind is AttentionKind.HCA:
            self.compressor = Compressor(c.hidden_size, c.head_dim, ratio, False, c.rms_norm_eps,
                                         dtype=dtype, device=device, fp8_qat_nope_dim=self.fp8_qat_nope_dim)
        self.rope = RotaryTable.for_config(c, compressed=self.kind is not AttentionKind.WINDOW)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] (after attn_norm) -> [T, D]; updates each sequence's state for this layer."""
        num_tokens = x.shape[0]
        cos, sin = batch.cos_sin(self.rope)
        q_lat = linear_norm_rope(self.wq_a, x, group=self.q_norm.weight.numel(), norm=True, eps=self.q_norm.eps,
                                 weight=self.q_norm.weight)  # [T, R], q_norm
        q = linear_norm_rope(self.wq_b, q_lat, group=self.head_dim, norm=True, eps=self.config.rms_norm_eps, cos=cos,
                             sin=sin).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, hd]: per-head
        # unweighted norm, then RoPE
        kv = linear_norm_rope(self.wkv, x, group=self.head_dim, norm=True, eps=self.kv_norm.eps,
                              weight=self.kv_norm.weight, cos=cos, sin=sin)  # [T, hd], kv_norm and RoPE
        if self.fp8_qat_nope_dim is not None:  # before storing and attending: every step reads these values
            kv = kv_nope_fp8_qat(kv, self.fp8_qat_nope_dim)
        if can_use_kernels(batch, kv):  # rotated back inside the attention launch
            out = batched_attention_core(self, batch, q, kv, x, q_lat, cos, sin)
        else:
            out = inverse_rope(self._torch_core(x, batch, q, kv, q_lat, cos, sin), cos, sin)  # undo the
            # rotation values carried in
        grouped = out.reshape(num_tokens, self.config.o_groups, -1)  # [T, G, H/G·hd]
        return self.wo_b(self.wo_a(grouped))

    def _torch_core(self, x, batch: ForwardBatch, q, kv, q_lat, cos, sin) -> torch.Tensor:
        """The per-sequence reference: -> [T, H, hd] before de-rotation; updates each state."""
        compressor_inputs = indexer_inputs = queries_i = None
        if self.compressor is not None:
            compressor_inputs = self.compressor.project(x, batch.positions)
        if self.indexer is not None:
            indexer_inputs = self.indexer.compressor.project(x, batch.positions)
            queries_i = self.indexer.project_queries(q_lat, x, cos, sin)

        out = torch.empty_like(q)
        for chunk, sl, start in zip(batch.chunks, batch.slices, batch.start_positions):
            state = chunk.state.layers[self.layer]
            keys, visible = self._keys_for_sequence(state, sl, start, batch.positions[sl], kv[sl],
                                                    compressor_inputs, indexer_inputs, queries_i)
            out[sl] = attend_with_sink(q[sl], keys, visible, self.attn_sink, self.scale)
        return out

    def _keys_for_sequence(self, state: LayerState, sl: slice, start: int, positions: torch.Tensor,
                           new_kv: torch.Tensor, compressor_inputs, indexer_inputs, queries_i
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update this sequence's stores with its S new tokens; return keys [L, hd], visible [S, L]."""
        window = self.config.sliding_window
        first_key_pos = max(0, start - window + 1)
        window_keys = torch.cat([state.window.read(first_key_pos).to(new_kv.dtype), new_kv])  # [Lw, hd]
        state.window.append(new_kv)
        key_positions = torch.arange(first_key_pos, start + new_kv.shape[0], device=new_kv.device)
        delta = positions[:, None] - key_positions[None, :]  # [S, Lw]
        visible = (delta >= 0) & (delta < window)
        if self.compressor is None:
            return window_keys, visible
        kv_in, score_in = compressor_inputs
        self.compressor.emit(state.compressor, kv_in[sl], score_in[sl], self.rope)
        rows = state.compressor.read_rows()  # [N, hd]
        if self.indexer is None:  # HCA: every closed window
            row_visible = torch.arange(rows.shape[0], device=rows.device)[None, :] < (
                (positions + 1) // self.compressor.ratio)[:, None]
        else:  # CSA: the indexer's choice among closed windows
            ikv_in, iscore_in = indexer_inputs
            self.indexer.compressor.emit(state.indexer, ikv_in[sl], iscore_in[sl], self.rope)
            queries, head_weights = queries_i
            row_visible = self.indexer.select(queries[sl], head_weights[sl], state.indexer.read_rows(), positions)
        keys = torch.cat([window_keys, rows.to(window_keys.dtype)])
        return keys, torch.cat([visible, row_visible], dim=1)
