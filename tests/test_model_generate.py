"""Generation helper (greedy against a transformers greedy loop) and the `moemesh generate` command."""

from __future__ import annotations

import json

import pytest
import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.generate import GenerationConfig, generate, generate_batch
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def models():
    config = tiny_config()
    hub_sd, hf_model = random_hub_state_dict(config, seed=4321)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    model = ReferenceModel(AttentionSide.from_state_dict(config, attention_sd), RoutedExperts.from_config(experts, config))
    return config, model, hf_model


def test_greedy_matches_transformers_greedy_loop(models):
    config, model, hf_model = models
    prompt = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = generate(model, prompt, GenerationConfig(max_new_tokens=14))
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(14):
            logits = hf_model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            tokens.append(int(logits.argmax()))
    assert ours == tokens[len(prompt):]


def test_batched_generation_equals_one_prompt_at_a_time(models):
    config, model, _ = models
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (5, 33, 17)]
    settings = GenerationConfig(max_new_tokens=9)
    assert generate_batch(model, prompts, settings) == [generate(model, p, settings) for p in prompts]


def test_stop_token_ends_generation(models):
    config, model, _ = models
    prompt = list(range(10, 30))
    free = generate(model, prompt, GenerationConfig(max_new_tokens=6))
    stopped = generate(model, prompt, GenerationConfig(max_new_tokens=6, stop_token_ids=(free[2],)))
    assert stopped == free[: free.index(free[2]) + 1]


def test_sampling_is_reproducible_with_a_seed(models):
    _, model, _ = models
    prompt = list(range(40, 60))
    first = generate(model, prompt, GenerationConfig(max_new_tokens=8, temperature=1.0, seed=5))
    again = generate(model, prompt, GenerationConfig(max_new_tokens=8, temperature=1.0, seed=5))
    other = generate(model, prompt, GenerationConfig(max_new_tokens=8, temperature=1.0, seed=6))
    assert first == again and first != other


# ------------------------------------------------------------------------------------ command
def _write_tiny_checkpoint(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from moemesh.common.checkpoint.writer import write_checkpoint
    from tiny_checkpoint_support import random_hub_state_dict as checkpoint_random_state
    from tiny_checkpoint_support import tiny_config as checkpoint_tiny_config

    config = checkpoint_tiny_config()
    write_checkpoint(path, config, checkpoint_random_state(config, seed=9, include_mtp=False))
    vocab = {"<unk>": 0, "</s>": 1}
    vocab.update({f"w{i}": i for i in range(2, config.vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("moemesh.common.checkpoint.writer")
    path = tmp_path_factory.mktemp("tiny_ckpt")
    return path, _write_tiny_checkpoint(path)


def test_generate_command_json_matches_helper(checkpoint, capsys):
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.cli import main

    path, config = checkpoint
    prompts = ["w5 w9 w17 w3 w3 w40 w2 w77 w9 w10 w11 w12", "w100 w101"]
    argv = ["generate", "--model", str(path), "--max-tokens", "5", "--json"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["prompt_token_ids"] for r in results] == [[int(w[1:]) for w in p.split()] for p in prompts]

    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = [(layer, e) for layer in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    for result in results:
        expected = generate(model, result["prompt_token_ids"],
                            GenerationConfig(max_new_tokens=5, stop_token_ids=(config.eos_token_id,)))
        assert result["generated_token_ids"] == expected
        assert result["text"].split() == [("</s>" if t == 1 else f"w{t}") for t in expected if t != 0]


def test_generate_command_chat_mode_runs(checkpoint, capsys):
    from moemesh.cli import main

    path, _ = checkpoint
    assert main(["generate", "--model", str(path), "--prompt", "w7 w8", "--chat", "--max-tokens", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["prompt_token_ids"]) > 2 and 1 <= len(result["generated_token_ids"]) <= 2


def test_generate_command_reference_numerics_changes_logits_not_the_interface(checkpoint, capsys):
    """--reference-numerics loads the official reference's numerics (FP8 KV QAT among them)."""
    from moemesh.cli import main
    from moemesh.commands.generate import _load_model

    path, _ = checkpoint
    default_model, _ = _load_model(str(path), "float32", "cpu")
    reference_model, _ = _load_model(str(path), "float32", "cpu", reference_numerics=True)
    assert reference_model.side.numerics.kv_fp8_qat and not default_model.side.numerics.kv_fp8_qat
    capsys.readouterr()  # drop what loading logged before the command configures logging
    assert main(["generate", "--model", str(path), "--prompt", "w3 w4", "--max-tokens", "2", "--json",
                 "--reference-numerics"]) == 0
    assert len(json.loads(capsys.readouterr().out)["generated_token_ids"]) <= 2
    assert main(["generate", "--model", str(path), "--prompt", "w3", "--distributed", "--reference-numerics"]) == 2
