"""`moemesh generate`: text generation with the single-process reference model.

Loads config, tokenizer and weights (dequantized by `common.checkpoint.reader`), then runs all
prompts together: prefill, then one decode step per token. `--distributed` runs the attention
worker and `--expert-workers` expert workers as processes over ZeroMQ, scheduled by the router's
scheduler (`moemesh.commands.generate_distributed`).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (hub format, with tokenizer.json)")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn (chat encoding)")
    parser.add_argument("--json", action="store_true", help="print JSON: token ids and text")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--reference-numerics", action="store_true",
                        help="the official reference's numerics instead of transformers': no shared-expert clamp, "
                             "routing weight before w2, FP8 KV QAT (single-process only)")
    parser.add_argument("--distributed", action="store_true",
                        help="run the attention worker and --expert-workers expert workers as separate processes")
    from moemesh.commands.generate_distributed import add_distributed_arguments

    add_distributed_arguments(parser)


def _load_model(path: str, dtype_name: str, device: str, reference_numerics: bool = False):
    import structlog

    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.checkpoint.reference_model import load_reference_model
    from moemesh.common.model.config import ModelConfig, NumericsConfig

    config = ModelConfig.load(path)
    numerics = NumericsConfig.reference(dtype_name) if reference_numerics else NumericsConfig(dtype=dtype_name)
    model = load_reference_model(CheckpointReader(path, config=config), numerics, device)
    structlog.get_logger().info("generate.model_loaded", path=path, dtype=dtype_name, device=device,
                                num_layers=config.num_hidden_layers,
                                num_expert_pairs=config.num_hidden_layers * config.n_routed_experts)
    return model, config


def _encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if not chat:
        return [tokenizer.encode(prompt).ids for prompt in prompts]
    from moemesh.common.chat.encoding import encode_messages

    # the chat text already carries BOS as text; do not let the tokenizer add another
    return [tokenizer.encode(encode_messages([{"role": "user", "content": prompt}]), add_special_tokens=False).ids
            for prompt in prompts]


def run(args: argparse.Namespace) -> int:
    if args.distributed and args.reference_numerics:
        print("--reference-numerics is not supported with --distributed yet", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print(f"--max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    from pathlib import Path

    from tokenizers import Tokenizer

    from moemesh.common.model.generate import GenerationConfig, generate_batch
    from moemesh.common.runtime.logging import configure_logging

    configure_logging("generate", None, "warning" if args.distributed else "info")  # stderr: stdout is the output

    tokenizer_path = Path(args.model) / "tokenizer.json"
    if not tokenizer_path.exists():
        print(f"{tokenizer_path}: not found", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    prompt_ids = _encode_prompts(tokenizer, args.prompt, args.chat)
    if args.distributed:
        from moemesh.commands.generate_distributed import run_distributed
        from moemesh.common.model.config import ModelConfig

        eos_token_id = ModelConfig.load(args.model).eos_token_id
        return run_distributed(args, tokenizer, prompt_ids, () if eos_token_id is None else (eos_token_id,))
    model, config = _load_model(args.model, args.dtype, args.device, args.reference_numerics)
    stop = () if config.eos_token_id is None else (config.eos_token_id,)
    generation = GenerationConfig(max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                  stop_token_ids=stop)
    generated = generate_batch(model, prompt_ids, generation)
    results = [
        {"prompt_token_ids": ids, "generated_token_ids": out, "text": tokenizer.decode(out)}
        for ids, out in zip(prompt_ids, generated)
    ]
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        for prompt, result in zip(args.prompt, results):
            print(f"{prompt}{result['text']}")
    return 0
