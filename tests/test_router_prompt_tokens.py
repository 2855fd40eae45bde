"""Text prompts get the tokenizer's special tokens as its configuration says, and the byte
bound on a text's token count (services/router/prompt_tokens.py) never exceeds the real count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_support import ScriptedEngine, tiny_tokenizer, tiny_tokenizer_json
from starlette.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from moemesh.common.chat import tokens as tk
from moemesh.services.router.app import build_app
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.prompt_tokens import PromptTokens, TokenizerConfigError, prompt_tokens_for, token_bytes_bound

KJV_DIR = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"


def _bos_tokenizer() -> Tokenizer:
    """The tests' byte-level BPE with a post-processor that puts BOS in front (as DeepSeek's does)."""
    tokenizer = tiny_tokenizer()
    bos = tokenizer.token_to_id(tk.BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{tk.BOS} $A", special_tokens=[(tk.BOS, bos)])
    return tokenizer


def _client(tokenizer: Tokenizer, **config):
    eos = tokenizer.token_to_id(tk.EOS)
    engine = ScriptedEngine(tokenizer.encode("Hello world", add_special_tokens=False).ids + [eos], eos_id=eos)
    fields = dict(model_name="m", max_model_len=256, eos_token_ids=(eos,), keep_alive_interval_s=0.1, **config)
    return engine, TestClient(build_app(GatewayConfig(**fields), engine, tokenizer))


def test_completion_text_prompts_get_bos_unless_asked_not_to():
    tokenizer = _bos_tokenizer()
    bos = tokenizer.token_to_id(tk.BOS)
    engine, client = _client(tokenizer)
    plain = tokenizer.encode("Hello world", add_special_tokens=False).ids
    answer = client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 2}).json()
    assert list(engine.submitted[-1].prompt_token_ids) == [bos, *plain] == tokenizer.encode("Hello world").ids
    assert answer["usage"]["prompt_tokens"] == len(plain) + 1  # what the model saw
    answer = client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 2,
                                                  "add_special_tokens": False}).json()
    assert list(engine.submitted[-1].prompt_token_ids) == plain and answer["usage"]["prompt_tokens"] == len(plain)
    # token ids are taken as given, BOS or not
    client.post("/v1/completions", json={"prompt": plain, "max_tokens": 2})
    assert list(engine.submitted[-1].prompt_token_ids) == plain
    # a list of text prompts: each gets its BOS
    client.post("/v1/completions", json={"prompt": ["Hello", "world"], "max_tokens": 2})
    assert [r.prompt_token_ids[0] for r in engine.submitted[-2:]] == [bos, bos]


def test_chat_prompts_have_exactly_one_bos():
    tokenizer = _bos_tokenizer()
    bos = tokenizer.token_to_id(tk.BOS)
    engine, client = _client(tokenizer)
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    answer = client.post("/v1/chat/completions", json=body).json()
    prompt = list(engine.submitted[-1].prompt_token_ids)
    assert prompt[0] == bos and prompt.count(bos) == 1
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    client.post("/v1/chat/completions", json={**body, "add_special_tokens": True})  # asked for: vLLM's meaning
    assert list(engine.submitted[-1].prompt_token_ids) == [bos, *prompt]


def test_tokenizer_config_decides_over_the_post_processor(tmp_path):
    tokenizer = tiny_tokenizer()  # no post-processor
    bos, eos = tokenizer.token_to_id(tk.BOS), tokenizer.token_to_id(tk.EOS)
    assert prompt_tokens_for(tokenizer, tmp_path).prefix_ids == ()  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "add_eos_token": True, "bos_token": {"content": tk.BOS}, "eos_token": tk.EOS}))
    rules = prompt_tokens_for(tokenizer, tmp_path)
    assert (rules.prefix_ids, rules.suffix_ids) == ((bos,), (eos,))
    assert rules.encode(tokenizer, ["Hello", "a b"], True) == [[bos, *tokenizer.encode(t).ids, eos] for t in ("Hello", "a b")]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert prompt_tokens_for(_bos_tokenizer(), tmp_path).prefix_ids == ()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<nope>"}))
    with pytest.raises(TokenizerConfigError, match="bos_token"):
        prompt_tokens_for(tokenizer, tmp_path)


@pytest.mark.skipif(not (KJV_DIR / "tokenizer.json").exists(), reason="embedded model missing")
def test_embedded_tokenizer_adds_bos_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    tokenizer = Tokenizer.from_file(str(KJV_DIR / "tokenizer.json"))
    rules = prompt_tokens_for(tokenizer, KJV_DIR)
    theirs = transformers.AutoTokenizer.from_pretrained(str(KJV_DIR))
    texts = ["In the beginning", " leading space", "héllo 😀", f"{tk.BOS}twice"]
    assert rules.encode(tokenizer, texts, True) == theirs(texts).input_ids
    assert rules.encode(tokenizer, texts, False) == theirs(texts, add_special_tokens=False).input_ids


# ------------------------------------------------------------------ the byte bound
_KJV = Tokenizer.from_file(str(KJV_DIR / "tokenizer.json")) if (KJV_DIR / "tokenizer.json").exists() else None
_TINY = tiny_tokenizer()


def _longest_tokens(tokenizer: Tokenizer | None, count: int = 30) -> list[str]:
    """The texts of the longest regular vocabulary entries: the texts the bound is tightest on."""
    if tokenizer is None:
        return []
    added = set(tokenizer.get_added_tokens_decoder())
    longest = sorted((i for t, i in tokenizer.get_vocab().items() if i not in added),
                     key=lambda i: -len(tokenizer.id_to_token(i)))[:count]
    return [tokenizer.decode([i]) for i in longest]


_PIECES = ["<｜", "｜>", tk.BOS, tk.EOS, "  ", "\n", *_longest_tokens(_KJV), *_longest_tokens(_TINY)]
_TEXT = st.lists(st.one_of(st.text(st.characters(codec="utf-8"), max_size=8), st.sampled_from(_PIECES)),
                 max_size=60).map("".join)


_BOUNDED = [(tokenizer, PromptTokens(bound=token_bytes_bound(tokenizer))) for tokenizer in filter(None, (_KJV, _TINY))]


@settings(max_examples=200, deadline=None)
@given(_TEXT)
def test_byte_bound_never_exceeds_the_token_count(text):
    for tokenizer, rules in _BOUNDED:
        assert rules.bound is not None
        assert rules.min_num_tokens(text, False) <= len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_no_bound_where_one_token_can_cover_any_number_of_bytes():
    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_bytes_bound(word_level) is None  # one <unk> for a word of any length
    spec = json.loads(tiny_tokenizer_json())
    spec["normalizer"] = {"type": "NFKC"}  # may shrink the text
    assert token_bytes_bound(Tokenizer.from_str(json.dumps(spec))) is None
    stripping = tiny_tokenizer()
    from tokenizers import AddedToken
    stripping.add_special_tokens([AddedToken("<strip>", lstrip=True)])  # eats any run of spaces before it
    assert token_bytes_bound(stripping) is None


def test_a_prompt_past_the_context_is_refused_before_tokenizing(monkeypatch):
    engine, client = _client(_bos_tokenizer())

    def never(*_):
        raise AssertionError("tokenized a prompt its byte count already refuses")

    monkeypatch.setattr(PromptTokens, "encode", never)
    response = client.post("/v1/completions", json={"prompt": "x" * 200_000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded" and "at least" in error["message"]
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 200_000}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert not engine.submitted
