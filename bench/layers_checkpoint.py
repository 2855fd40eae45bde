"""`moemesh bench layers --checkpoint DIR`: the timed layers read from a checkpoint on disk by the loaders the
serving workers use (`load_attention_side`: FP8 linears kept FP8; `ExpertHoldings`: the routed experts stacked
in their stored FP4 / FP8 format), so per-layer figures can be compared with those of the random layers built
in memory. Every main layer of the checkpoint is timed; write a few full-width layers with
`moemesh bench make-checkpoint --preset v4-flash --layers N`.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_checkpoint_layers(path: Path, device: torch.device, dtype: torch.dtype):
    """(config, attention side, routed experts) of the checkpoint at `path` on `device`, activations in `dtype`."""
    from moemesh.common.checkpoint.expert_holdings import ExpertHoldings
    from moemesh.common.checkpoint.expert_stacks import ExpertDtype
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.checkpoint.side_loading import load_attention_side
    from moemesh.common.model.config import NumericsConfig

    reader = CheckpointReader(str(path))
    config = reader.config
    numerics = NumericsConfig(dtype=str(dtype).removeprefix("torch."))
    side = load_attention_side(reader, numerics, device)
    holdings = ExpertHoldings(device, ExpertDtype.NATIVE, numerics.route_weight_before_w2)
    holdings.load(reader, [(layer, expert) for layer in range(config.num_hidden_layers)
                           for expert in range(config.n_routed_experts)])
    if holdings.experts is None:
        raise ValueError(f"{path}: its routed experts are stored as floats; bench layers times FP4 / FP8 experts")
    holdings.experts.connect_gates(side.gates())
    return config, side, holdings.experts
