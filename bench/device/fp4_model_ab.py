"""A/B of the tiny bf16 model (kernels vs torch path) under different expert-kernel choices.

Diagnoses tests/test_quantized_cuda.py::test_model_kernels_match_torch_path[bfloat16-...] (a
relative error of 0.058 against a 0.05 bound): if the error is the same with the portable JOIN decode
and no split-K as with the default, the expert kernels are not the cause. Prints one
line per (choice, seed): prefill and decode relative errors. Run on CUDA:
`python3 bench/device/fp4_model_ab.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from moemesh.common.kernels import fp4_experts
from moemesh.common.kernels.expert_configs import Fp4Decode, choose_grouped_config
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.config import AttentionKind, NumericsConfig
from moemesh.common.model.quantized import Fp8Linear, KernelBackend
from moemesh.common.model.random_init import random_model, tiny_flash_like_config
from moemesh.common.model.reference import ReferenceModel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _set_backend(side, experts, backend: KernelBackend) -> None:
    for module in side.modules():
        if isinstance(module, Fp8Linear):
            module.backend = backend
    experts.backend = backend


def _errors(seed: int) -> tuple[float, float]:
    config = tiny_flash_like_config([AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA],
                                    kernel_friendly=True, index_topk=64)
    side, experts = random_model(config, "cuda", numerics=NumericsConfig(dtype="bfloat16"), seed=seed)
    tokens = torch.randint(0, config.vocab_size, (80,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    outputs = []
    for chosen in (KernelBackend.KERNEL, KernelBackend.TORCH):
        _set_backend(side, experts, chosen)
        model = ReferenceModel(side, experts)
        state = model.new_sequence()
        prefill = model.forward(tokens[:72], [SequenceChunk(state, 72)])
        decode = torch.cat([model.forward(tokens[t:t + 1], [SequenceChunk(state, 1)]) for t in range(72, 80)])
        outputs.append((prefill, decode))
    return _rel(outputs[0][0], outputs[1][0]), _rel(outputs[0][1], outputs[1][1])


def main() -> None:
    choices = {
        "default": choose_grouped_config,
        "join_no_split": lambda *a, **k: dataclasses.replace(choose_grouped_config(*a, **k), split_k=1,
                                                              fp4_decode=Fp4Decode.JOIN),
        "halves_no_split": lambda *a, **k: dataclasses.replace(choose_grouped_config(*a, **k), split_k=1,
                                                                fp4_decode=Fp4Decode.HALVES),
        "asm_quad_no_split": lambda *a, **k: dataclasses.replace(choose_grouped_config(*a, **k), split_k=1),
    }
    for name, chooser in choices.items():
        fp4_experts.choose_grouped_config = chooser
        for seed in (3, 4, 5):
            prefill, decode = _errors(seed)
            print(f"model A/B {name:18} seed {seed}: prefill rel {prefill:.4f}  decode rel {decode:.4f}", flush=True)
    fp4_experts.choose_grouped_config = choose_grouped_config


if __name__ == "__main__":
    main()
