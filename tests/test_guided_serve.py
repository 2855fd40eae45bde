"""logit_bias and response_format through `moemesh serve` on the default model (real processes).

Two servers: speculation off and adaptive speculation (the drafter's own widths, so outputs do
not depend on host timings). Checked: a -100 bias on the greedy token changes the output and
that token never appears, +100 forces a token; garbage logit_bias / response_format is a 400
naming the field; json_schema outputs validate against their schema and json_object outputs
parse, greedy and sampled, on both endpoints; speculative and plain greedy outputs are the
same under a grammar; a grammar cut by max_tokens ends with finish_reason "length".
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from tokenizers import Tokenizer

from spec_support import DEFAULT_MODEL, start_serve

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing"),
]

MODEL = "kjv-dsv4-mini"
PROMPT = "In the beginning God"
SCHEMA = {  # every string is bounded, so an output always completes within MAX_TOKENS
    "type": "object",
    "properties": {
        "book": {"type": "string", "maxLength": 12},
        "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
        "holy": {"type": "boolean"},
        "mood": {"enum": ["joy", "wrath", "peace"]},
    },
    "required": ["book", "chapter", "holy", "mood"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "verse", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 64


def _serve(tmp_path_factory, *args):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOEMESH_SPEC_WIDTH_POLICY", "drafter")  # serve's processes inherit it
        server = start_serve(tmp_path_factory.mktemp("guided"), *args)
    if "moemesh serving" not in server.first_line:
        server.stop()
        pytest.fail(f"serve did not start: {server.first_line!r}\n{server.logs()}")
    return server


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    server = _serve(tmp_path_factory, "--speculation", "off")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def speculative(tmp_path_factory):
    server = _serve(tmp_path_factory)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))


async def _post_all(base_url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(client.post(f"{base_url}{path}", json={"model": MODEL, **body})
                                      for body in bodies))


def _ok(replies: list[httpx.Response]) -> list[dict]:
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json() for reply in replies]


def _guided_bodies(tokenizer) -> list[dict]:
    """Completions with a grammar, greedy and sampled. json_object leaves keys and values free;
    a bias towards '"' and '}' makes the KJV model close its strings and the object early."""
    closing = {str(tokenizer.token_to_id('"')): 12, str(tokenizer.token_to_id("}")): 8}
    common = {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    return [
        {**common, "temperature": 0, "response_format": SCHEMA_FORMAT},
        {**common, "temperature": 1.0, "seed": 7, "n": 2, "response_format": SCHEMA_FORMAT},
        {**common, "temperature": 0, "response_format": {"type": "json_object"}, "logit_bias": closing},
        {**common, "temperature": 1.0, "seed": 5, "response_format": {"type": "json_object"}, "logit_bias": closing},
    ]


def _is_grammar_prefix(text: str, tokenizer) -> bool:
    """Whether llguidance's json_object grammar accepts `text` as an unfinished output."""
    from moemesh.services.router.guided_decoding import GrammarTokenizer, parse_response_format

    guide = GrammarTokenizer(tokenizer, (1,)).new_guide(parse_response_format({"type": "json_object"}))
    return guide.matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False).ids) \
        and not guide.matcher.is_accepting()


def _check_guided(replies: list[dict], bodies: list[dict], tokenizer) -> list[str]:
    """Every schema output completes and validates; a json_object output parses when complete.
    A json_object (free-length keys: the KJV model may loop inside one) may instead reach
    max_tokens: then it must end with "length" and be an unfinished object the grammar accepts."""
    texts = []
    for reply, body in zip(replies, bodies):
        for choice in reply["choices"]:
            texts.append(choice["text"])
            if body["response_format"]["type"] == "json_object" and choice["finish_reason"] == "length":
                assert _is_grammar_prefix(choice["text"], tokenizer), choice
                continue
            assert choice["finish_reason"] == "stop", choice
            value = json.loads(choice["text"])
            if body["response_format"]["type"] == "json_schema":
                jsonschema.validate(value, SCHEMA)
            else:
                assert isinstance(value, dict)
    return texts


def test_logit_bias_bans_and_forces_tokens(plain, tokenizer):
    first, = _ok(asyncio.run(_post_all(plain.base_url, "/v1/completions", [
        {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}])))
    greedy_text = first["choices"][0]["text"]
    greedy_ids = tokenizer.encode(greedy_text, add_special_tokens=False).ids
    assert len(greedy_ids) == 1, greedy_text
    banned = greedy_ids[0]
    forced = tokenizer.encode(" LORD", add_special_tokens=False).ids
    assert len(forced) == 1
    base, ban, force = _ok(asyncio.run(_post_all(plain.base_url, "/v1/completions", [
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0},
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0, "logit_bias": {str(banned): -100}},
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0, "logit_bias": {str(forced[0]): 100}},
    ])))
    base_tokens = base["choices"][0]["logprobs"]["tokens"]
    ban_tokens = ban["choices"][0]["logprobs"]["tokens"]
    assert base_tokens[0] == greedy_text and greedy_text in base_tokens
    assert ban["choices"][0]["text"] != base["choices"][0]["text"]
    assert greedy_text not in ban_tokens, ban_tokens
    assert force["choices"][0]["logprobs"]["tokens"] == [" LORD"] * 6
    assert force["choices"][0]["finish_reason"] == "length"
    chat, = _ok(asyncio.run(_post_all(plain.base_url, "/v1/chat/completions", [
        {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, "temperature": 0,
         "logit_bias": {str(forced[0]): 100}}])))
    assert chat["choices"][0]["message"]["content"] == " LORD" * 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 500}), ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"5": "high"}), ("logit_bias", "ban"), ("response_format", {"type": "yaml"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}),
])
def test_garbage_output_controls_are_400_naming_the_field(plain, path, field, value):
    body = {"max_tokens": 4, field: value}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    reply, = asyncio.run(_post_all(plain.base_url, path, [body]))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def test_grammar_outputs_parse_and_validate_and_speculation_changes_no_greedy_output(plain, speculative, tokenizer):
    bodies = _guided_bodies(tokenizer)
    plain_replies = _ok(asyncio.run(_post_all(plain.base_url, "/v1/completions", bodies)))
    plain_texts = _check_guided(plain_replies, bodies, tokenizer)
    spec_replies = _ok(asyncio.run(_post_all(speculative.base_url, "/v1/completions", bodies)))
    spec_texts = _check_guided(spec_replies, bodies, tokenizer)
    assert sum(reply["usage"]["speculative"]["draft_tokens"] for reply in spec_replies) > 0  # speculation ran
    greedy = [0, 3]  # bodies 0 and 2 are greedy (body 1 has n = 2)
    assert [spec_texts[i] for i in greedy] == [plain_texts[i] for i in greedy]


def test_chat_json_schema_and_a_grammar_cut_by_max_tokens(plain):
    chat = {"messages": [{"role": "user", "content": "Name a verse."}], "temperature": 0,
            "response_format": SCHEMA_FORMAT}
    full, cut = _ok(asyncio.run(_post_all(plain.base_url, "/v1/chat/completions", [
        {**chat, "max_tokens": MAX_TOKENS}, {**chat, "max_tokens": 3}])))
    assert full["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(full["choices"][0]["message"]["content"]), SCHEMA)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert full["choices"][0]["message"]["content"].startswith(cut["choices"][0]["message"]["content"])
