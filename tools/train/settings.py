"""Settings of the default-model training run: the model configs and the run's hyper-parameters.

Three model sizes share one schedule (docs/model.md §1.2 in miniature): layers [W, W, CSA, HCA, CSA,
HCA], the first three hash-routed, a 128-token window, CSA ratio 4 with a 16-head indexer whose
top-k (64) is below the 256 compressed rows of a 1024-token training window, HCA ratio 128, mHC
with 4 streams, routed + shared experts, and three DSpark stages fed by the last three layers.
`full` is the shipped size (all FP8 dims multiples of 128); `recite` the same with 4x wider routed
and shared experts (8 × 512 instead of 8 × 128: 39.2 MB in hub format instead of 25.3 MB), sized
to memorise the whole KJV (docs/default-model.md); `smoke` is a narrow copy for CPU checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID, MASK_ID

NUM_MAIN_LAYERS = 6
NUM_DRAFT_STAGES = 3
SIZES = ("full", "recite", "smoke")


def model_config_dict(size: str, vocab_size: int) -> dict[str, Any]:
    """Hub-form `config.json` of the default model (`size` one of SIZES)."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
    full = size != "smoke"
    hidden = 256 if full else 128
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": NUM_MAIN_LAYERS,
        "num_attention_heads": 4 if full else 2,
        "num_key_value_heads": 1,
        "head_dim": 128 if full else 64,
        "qk_rope_head_dim": 64 if full else 32,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 128 if full else 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512 if size == "recite" else 128,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "scoring_func": "sqrtsoftplus",
        "compress_ratios": [0, 0, 4, 128, 4, 128] + [0] * NUM_DRAFT_STAGES,
        "num_hash_layers": 3,
        "sliding_window": 128,
        "index_n_heads": 16,
        "index_head_dim": 64 if full else 32,
        "index_topk": 64 if full else 16,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "num_nextn_predict_layers": NUM_DRAFT_STAGES,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "expert_dtype": "fp4",
        "dspark_block_size": 5,
        "dspark_markov_rank": 32 if full else 16,
        "dspark_target_layer_ids": [NUM_MAIN_LAYERS - 3, NUM_MAIN_LAYERS - 2, NUM_MAIN_LAYERS - 1],
        "dspark_noise_token_id": MASK_ID,
    }


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides the result (logged in full at the start of the run).

    target_steps / drafter_steps: None means "as many as fit `time_budget_s`", measured on the
    first steps and then fixed (and logged, so the run can be repeated with the numbers given).
    """

    size: str = "full"
    seed: int = 1611
    seq_len: int = 1024
    batch_size: int = 16
    target_steps: int | None = None
    target_lr: float = 3e-3
    target_warmup_steps: int = 50
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3  # aux-loss-free balancing of the learned routers
    drafter_steps: int | None = None
    drafter_lr: float = 2e-3
    drafter_warmup_steps: int = 20
    anchors_per_sequence: int = 48
    precision: str = "bf16"  # "bf16": bf16 autocast on CUDA; "fp32" everywhere else
    time_budget_s: float = 480.0  # whole run (target + drafter + export) when steps are None
    target_time_share: float = 0.68
    eval_batch_size: int = 8
    batched_attention: bool = True  # False: the model core's per-sequence path (slower, same math)
    qat: bool = True  # forward/backward on the FP8 / FP4 values the export stores (tools.train.quant_shadow)
    compile: bool = False  # torch.compile the training step's forward + loss (CUDA; compile time counts)
    log_every_steps: int = 25

    @classmethod
    def smoke(cls) -> "TrainSettings":
        return cls(size="smoke", seq_len=256, batch_size=2, target_steps=20, target_warmup_steps=5,
                   drafter_steps=10, drafter_warmup_steps=2, anchors_per_sequence=8, precision="fp32",
                   eval_batch_size=4)
