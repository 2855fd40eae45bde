"""Speculative decoding inside `moemesh serve` on the default model (real drafter, real processes).

Greedy outputs with speculation (adaptive, adaptive with the router's cost-aware widths, and fixed
width 3) must equal the single-process reference token for token, for concurrent requests whose decode crosses CSA (every 4 tokens)
and window / HCA (128) boundaries; a sampled request must run speculation and be reproducible
from its seed; a width above dspark_block_size must be refused before anything starts.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import pytest

from spec_support import DEFAULT_MODEL, REPO_ROOT, start_serve

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists() and not any(DEFAULT_MODEL.glob("*.safetensors")),
                       reason="default model weights missing"),
]

EOS_ID = 1
MAX_TOKENS = 24
VERSE = "And God said, Let there be light: and there was light. And God saw the light, that it was good. "
PROMPTS = [
    "In the beginning God",
    "And the LORD said unto Moses,",
    VERSE * 5,  # ~120 tokens: decode crosses position 128 (window ring wrap, HCA window close)
    "For God so loved the world",
]


@pytest.fixture(scope="module")
def reference():
    from tokenizers import Tokenizer

    from moemesh.commands.generate import _load_model
    from moemesh.common.model.generate import GenerationConfig, generate_batch

    model, _ = _load_model(str(DEFAULT_MODEL), "float32", "cpu")
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes

    outputs = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids  # as the server: BOS first
        tokens = generate_batch(model, [ids], GenerationConfig(max_new_tokens=MAX_TOKENS, stop_token_ids=(EOS_ID,)))[0]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, token_bytes=TokenBytes(tokenizer))
        outputs[prompt] = detokenizer.add(tokens) + detokenizer.finish()
    return outputs, len(tokenizer.encode(VERSE * 5, add_special_tokens=True).ids)


def _serve(tmp_path_factory, *args):
    server = start_serve(tmp_path_factory.mktemp("spec"), *args)
    if "moemesh serving" not in server.first_line:
        server.stop()
        pytest.fail(f"serve did not start: {server.first_line!r}\n{server.logs()}")
    return server


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory):
    """The default (adaptive, width = block size) with the confidence rule alone: the router keeps the
    drafter's widths, so the sampled test's drafts (and its seeded texts) do not depend on this host's
    timings. The cost-aware router has its own test below."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOEMESH_SPEC_WIDTH_POLICY", "drafter")  # serve's processes inherit it
        server = _serve(tmp_path_factory)
    yield server
    assert server.stop() == 0


async def _complete_all(base_url: str, prompts, **body):
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(prompt):
            reply = await client.post(f"{base_url}/v1/completions", json={
                "model": "kjv-dsv4-mini", "prompt": prompt, "max_tokens": MAX_TOKENS, **body})
            assert reply.status_code == 200, reply.text
            return reply.json()
        return await asyncio.gather(*(one(prompt) for prompt in prompts))


def _text(reply: dict) -> str:
    return reply["choices"][0]["text"]


def _check_greedy_texts(server, reference):
    outputs, long_prompt_len = reference
    assert long_prompt_len + MAX_TOKENS > 128 > long_prompt_len, long_prompt_len
    replies = asyncio.run(_complete_all(server.base_url, PROMPTS, temperature=0))
    for prompt, reply in zip(PROMPTS, replies):
        assert _text(reply) == outputs[prompt], prompt
    return replies


def _check_greedy(server, reference):
    replies = _check_greedy_texts(server, reference)
    assert sum(reply["usage"]["speculative"]["draft_tokens"] for reply in replies) > 0  # speculation ran
    return replies


def test_greedy_adaptive_equals_reference_with_concurrent_requests(adaptive, reference):
    assert "speculation adaptive, width 5" in adaptive.first_line  # the default with a drafter: adaptive, width γ
    replies = _check_greedy(adaptive, reference)
    assert any(reply["usage"]["speculative"]["accepted_tokens"] > 0 for reply in replies)


def test_sampled_speculation_runs_and_is_reproducible_with_a_seed(adaptive):
    body = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}
    first = asyncio.run(_complete_all(adaptive.base_url, PROMPTS[:2], **body))
    second = asyncio.run(_complete_all(adaptive.base_url, PROMPTS[:2], **body))
    for a, b in zip(first, second):
        assert _text(a) == _text(b)
        assert a["usage"]["speculative"]["ran"] is True and a["usage"]["speculative"]["draft_tokens"] > 0
    other = asyncio.run(_complete_all(adaptive.base_url, PROMPTS[:2], **{**body, "seed": 99}))
    assert [_text(r) for r in other] != [_text(r) for r in first]


def test_health_and_metrics_report_the_drafter(adaptive):
    health = httpx.get(f"{adaptive.base_url}/health", timeout=10).json()
    assert health["services"]["draft"] == "ok"
    text = httpx.get(f"{adaptive.base_url}/metrics", timeout=10).text
    drafted = re.search(r'^moemesh_spec_position_draft_tokens_total\{position="0"\} ([0-9.e+]+)$', text, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0, text[-2000:]


@pytest.mark.slow  # a second serve (~20 s)
def test_greedy_fixed_width_equals_reference(tmp_path_factory, reference):
    server = _serve(tmp_path_factory, "--speculation", "fixed", "--spec-width", "3")
    try:
        assert "speculation fixed, width 3" in server.first_line
        replies = _check_greedy(server, reference)
        for reply in replies:
            speculative = reply["usage"]["speculative"]
            if speculative["ran"]:  # every verify step carried at most 3 drafts
                assert speculative["mean_accepted_length"] <= 4.0
    finally:
        assert server.stop() == 0


@pytest.mark.slow  # a second serve (~20 s)
def test_greedy_adaptive_with_the_cost_aware_router_equals_reference(tmp_path_factory, reference):
    """The router's cost-aware widths (MOEMESH_SPEC_WIDTH_POLICY=cost, costs learned online from this
    host's step timings, so the widths vary from run to run) never change greedy outputs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOEMESH_SPEC_WIDTH_POLICY", "cost")  # serve's processes inherit it
        server = _serve(tmp_path_factory)
    try:
        _check_greedy_texts(server, reference)
        engine = httpx.get(f"{server.base_url}/status.json", timeout=10).json()["engine"]
        assert engine["spec_width_policy"] == "cost"
        assert engine["spec_num_draft_requests"] > 0 and engine["spec_policy_num_proposed_drafts"] > 0, engine
        assert "spec_cost_model" in engine
    finally:
        assert server.stop() == 0


def test_width_above_block_size_is_refused_at_start(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moemesh.cli", "serve", "--spec-width", "7", "--run-dir",
                             str(tmp_path), "--port", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--spec-width 7 exceeds the drafter's block size (dspark_block_size = 5)" in result.stderr
    assert not (tmp_path / "deployment.toml").exists()  # nothing was started
