"""`moemesh serve --experts-in-attention` end to end on the default model (real processes, HTTP).

On one device serve gives every routed expert to the attention worker by default (the expert worker
joins empty); a placement file can split them between the attention worker and an expert worker.
Greedy completions equal the single-process reference's text in both layouts.
"""

from __future__ import annotations

import asyncio
import json
import tomllib

import httpx
import pytest

from spec_support import DEFAULT_MODEL, start_serve

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing"),
]

EOS_ID = 1
MAX_TOKENS = 16
PROMPTS = ["In the beginning God", "And the LORD said unto Moses,", "For God so loved the world"]


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    from tokenizers import Tokenizer

    from moemesh.commands.generate import _load_model
    from moemesh.common.model.generate import GenerationConfig, generate_batch
    from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes

    model, _ = _load_model(str(DEFAULT_MODEL), "float32", "cpu")
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    outputs = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids
        tokens = generate_batch(model, [ids], GenerationConfig(max_new_tokens=MAX_TOKENS, stop_token_ids=(EOS_ID,)))[0]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, token_bytes=TokenBytes(tokenizer))
        outputs[prompt] = detokenizer.add(tokens) + detokenizer.finish()
    return outputs


def _greedy_texts(base_url: str) -> dict[str, str]:
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt):
                reply = await client.post(f"{base_url}/v1/completions", json={
                    "model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
                assert reply.status_code == 200, reply.text
                return reply.json()["choices"][0]["text"]
            return await asyncio.gather(*(one(prompt) for prompt in PROMPTS))
    return dict(zip(PROMPTS, asyncio.run(run())))


def _serve_and_check(run_dir, reference, *args) -> dict:
    """Serve with `args`, compare greedy texts with the reference, stop; the deployment serve wrote."""
    server = start_serve(run_dir, "--speculation", "off", *args)
    try:
        assert "moemesh serving" in server.first_line, server.logs()
        assert _greedy_texts(server.base_url) == reference
        health = httpx.get(f"{server.base_url}/health", timeout=10).json()
        assert health["services"] == {"attention-0": "ok", "expert-0": "ok"}, health
    finally:
        assert server.stop() == 0, server.logs()
    loaded = [json.loads(line) for line in (run_dir / "logs" / "attention-0.log").read_text().splitlines()
              if '"attention.loaded"' in line]
    with open(run_dir / "deployment.toml", "rb") as handle:
        return {"deployment": tomllib.load(handle), "loaded": loaded[-1]}


def test_one_device_serves_every_expert_from_the_attention_worker_by_default(tmp_path, reference):
    run = _serve_and_check(tmp_path / "run", reference)
    deployment = run["deployment"]
    assert deployment["attention"][0]["placement"] == "all"
    assert [w["placement"] for w in deployment["expert"]] == ["none"]
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert run["loaded"]["num_local_experts"] == config["num_hidden_layers"] * config["n_routed_experts"]


def test_a_placement_file_splits_experts_between_attention_and_an_expert_worker(tmp_path, reference):
    from moemesh.common.placement.placement_file import write_placement
    from moemesh.common.placement.worker_holdings import round_robin

    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    placement = round_robin(["attention-0", "expert-0"], ["cpu", "cpu"], config["num_hidden_layers"],
                            config["n_routed_experts"], 1)
    write_placement(tmp_path / "split.toml", placement)
    run = _serve_and_check(tmp_path / "run", reference, "--experts-in-attention", str(tmp_path / "split.toml"))
    assert run["loaded"]["num_local_experts"] == config["num_hidden_layers"] * config["n_routed_experts"] // 2
    assert run["deployment"]["expert"][0]["placement"] == str(tmp_path / "split.toml")
