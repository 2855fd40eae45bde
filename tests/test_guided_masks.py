"""Grammar token masks and logit bias: packing, the worker-side application, the router's guide.

Unit level: the packed int32 layout round-trips through torch and matches llguidance's own
masks; applying masks sends disallowed logits to -inf and leaves other rows alone; the
router's TokenGuide walks drafts speculatively and rolls back; the StepPlan carries the masks
as a numpy-encoded tensor frame; logit_bias enters process_logits before penalties; request
validation refuses bad logit_bias / response_format with a 400 naming them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.services.attention.sampling import SamplingBatch, process_logits
from moemesh.services.attention.sampling.token_masks import apply_token_masks, pack_token_masks, unpack_token_masks
from moemesh.services.router.guided_decoding import (
    GrammarTokenizer,
    ResponseFormat,
    attach_token_masks,
    parse_logit_bias,
    parse_response_format,
)
from moemesh.services.router.protocol import ProtocolError
from moemesh.services.router.scheduler.request import FinishReason
from spec_support import DEFAULT_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer):
    return GrammarTokenizer(tokenizer, (1,))


def _allowed_ids(rows: np.ndarray) -> list[set[int]]:
    bits = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")  # [N, words * 32]
    return [set(np.nonzero(row)[0].tolist()) for row in bits]


def test_pack_and_unpack_round_trip_with_sign_bits_and_a_larger_model_vocabulary():
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 70, generator=generator) < 0.5  # 70 tokens: 3 words, the last partly used
    allowed[:, 31] = True  # the sign bit of word 0
    words = pack_token_masks(allowed)
    assert words.dtype == torch.int32 and words.shape == (3, 3)
    assert torch.equal(unpack_token_masks(words, 70), allowed)
    wider = unpack_token_masks(words, 100)  # model vocabulary beyond the mask: disallowed
    assert torch.equal(wider[:, :70], allowed) and not wider[:, 70:].any()
    packed_np = np.packbits(allowed.numpy(), axis=1, bitorder="little")  # the llguidance layout, bytes
    padded = np.zeros((3, 12), dtype=np.uint8)
    padded[:, :packed_np.shape[1]] = packed_np
    assert np.array_equal(padded.view(np.int32), words.numpy())


def test_apply_token_masks_masks_listed_rows_only():
    logits = torch.randn(4, 40)
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[0, [3, 7]] = True
    allowed[1, 39] = True
    masks = pack_token_masks(allowed)
    out = apply_token_masks(logits, masks, logit_rows=[2, 0], mask_rows=[0, 1])
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert torch.isinf(out[2]).sum() == 38 and out[2, 3] == logits[2, 3] and out[2, 7] == logits[2, 7]
    assert out[0].argmax() == 39 and torch.isfinite(out[0]).sum() == 1
    assert torch.equal(apply_token_masks(logits, masks, [], []), logits)


def test_logit_bias_is_added_before_penalties_and_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    params = SamplingParams(temperature=0.5, logit_bias=((0, 4.0), (2, -100.0)), repetition_penalty=2.0)
    batch = SamplingBatch.from_params([params], 4, "cpu")
    from moemesh.services.attention.sampling import build_token_history

    history = build_token_history([[0]], [[]], 4, "cpu")  # token 0 seen: repetition penalty applies
    out = process_logits(logits, batch, history)
    expected = torch.tensor([[(1.0 + 4.0) / 2.0, 2.0, 3.0 - 100.0, 0.5]]) / 0.5  # only token 0 is penalised
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([[1.0, 2.0, 3.0, 0.5]]))  # input untouched
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingBatch.from_params([SamplingParams(logit_bias=((4, 1.0),))], 4, "cpu")


def test_logit_bias_survives_the_wire_and_refuses_bad_values():
    params = SamplingParams(logit_bias=((3, -100.0), (9, 2.5)))
    assert SamplingParams.from_wire(params.to_wire()) == params
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((9, 1.0), (3, 1.0)))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_wire({"logit_bias": [["x", 1]]})


@pytest.mark.parametrize("value", [
    [1, 2], {"abc": 1}, {"5": "high"}, {"5": 101}, {"5": -100.5}, {"-1": 3}, {"12288": 3}, {"5": True},
    {"5": float("nan")},
])
def test_parse_logit_bias_refuses_garbage(value):
    with pytest.raises(ProtocolError) as caught:
        parse_logit_bias(value, 12288)
    assert caught.value.param == "logit_bias" and caught.value.status == 400


def test_parse_logit_bias_accepts_the_openai_form():
    assert parse_logit_bias({"17": -100, "5": 2.5, "0": 100}, 12288) == ((0, 100.0), (5, 2.5), (17, -100.0))
    assert parse_logit_bias(None, 10) == ()


@pytest.mark.parametrize("value", [
    "json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}},
])
def test_parse_response_format_refuses_bad_formats(value):
    with pytest.raises(ProtocolError) as caught:
        parse_response_format(value)
    assert caught.value.param == "response_format" and caught.value.status == 400


def test_parse_response_format_kinds():
    assert parse_response_format(None) is None and parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}).kind == "json_object"
    parsed = parse_response_format({"type": "json_schema", "json_schema": {
        "name": "point", "strict": True, "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}})
    assert parsed.kind == "json_schema" and parsed.name == "point"


def test_guide_masks_follow_the_grammar_and_roll_back_drafts(tokenizer, grammar_tokenizer):
    guide = grammar_tokenizer.new_guide(parse_response_format({"type": "json_object"}))
    brace, quote, letter = (tokenizer.token_to_id(t) for t in ("{", '"', "a"))
    first = _allowed_ids(guide.masks())[0]
    assert brace in first and quote not in first and 1 not in first  # an object must open first
    rows = guide.masks([brace, quote, letter])
    assert rows.shape == (4, 384)
    allowed = _allowed_ids(rows)
    assert allowed[0] == first  # the matcher was rolled back: position 0 unchanged
    assert quote in allowed[1] and brace not in allowed[1]  # after "{": a key or "}"
    assert len(allowed[3]) > 100  # inside a string almost anything goes
    assert _allowed_ids(guide.masks())[0] == first  # still at the start
    refused = _allowed_ids(guide.masks([quote, brace]))  # draft 0 breaks the grammar
    assert refused[0] == first and len(refused[1]) == len(refused[2]) == 384 * 32  # unused rows: all allowed
    for token_id in tokenizer.encode('{"a":1', add_special_tokens=False).ids:
        assert guide.advance(token_id) is None
    close = tokenizer.token_to_id("}")
    assert close in _allowed_ids(guide.masks())[0]
    assert guide.advance(close) is FinishReason.STOP  # the object is complete
    other = grammar_tokenizer.new_guide(parse_response_format({"type": "json_object"}))
    assert other.advance(quote) is FinishReason.ERROR


def test_json_schema_guide_allows_only_schema_keys(tokenizer, grammar_tokenizer):
    schema = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
              "additionalProperties": False}
    guide = grammar_tokenizer.new_guide(parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}))
    text = ""
    for _ in range(20):  # greedy walk: always the lowest allowed token id
        allowed = sorted(_allowed_ids(guide.masks())[0])
        token_id = allowed[0]
        text += tokenizer.decode([token_id], skip_special_tokens=False)
        if guide.advance(token_id) is FinishReason.STOP:
            break
    assert json.loads(text) in ({"yes": True}, {"yes": False}), text


def test_step_plan_carries_masks_as_a_tensor_frame_from_numpy(tokenizer, grammar_tokenizer):
    guide = grammar_tokenizer.new_guide(parse_response_format({"type": "json_object"}))
    brace = tokenizer.token_to_id("{")
    plan = m.StepPlan(step_id=3, sequences=(
        m.ScheduledSequence("free", 0, (5,), 10, ((0,),), True),
        m.ScheduledSequence("prefill", 1, (5, 6), 0, ((1,),), False),
        m.ScheduledSequence("json", 2, (7, brace), 4, ((2,),), True, draft_token_ids=(brace,)),
    ))
    guides = {"json": guide}
    plan = attach_token_masks(plan, guides.get)
    assert [s.token_mask_row for s in plan.sequences] == [None, None, 0]
    assert isinstance(plan.token_masks, np.ndarray) and plan.token_masks.shape == (2, 384)
    frames = codec.encode(plan)
    assert len(frames) == 2  # the header and one tensor frame
    decoded = codec.decode(frames)
    assert decoded.token_masks.dtype == torch.int32
    assert np.array_equal(decoded.token_masks.numpy(), plan.token_masks)
    assert attach_token_masks(m.StepPlan(step_id=4, sequences=plan.sequences[:2]), guides.get).token_masks is None


def test_response_format_is_frozen_data():
    parsed = parse_response_format({"type": "json_object"})
    assert isinstance(parsed, ResponseFormat) and isinstance(parsed.grammar, str)


def test_guide_starts_after_the_end_of_thinking(tokenizer, grammar_tokenizer):
    think_end = 9  # any token id standing for the end of the reasoning
    brace = tokenizer.token_to_id("{")
    word = tokenizer.encode(" the", add_special_tokens=False).ids[0]
    guide = grammar_tokenizer.new_guide(parse_response_format({"type": "json_object"}), start_after_token_id=think_end)
    assert guide.masks() is None and guide.masks([word, word]) is None  # reasoning: unconstrained
    rows = guide.masks([word, think_end, brace])  # the drafts end the reasoning at draft 1
    allowed = _allowed_ids(rows)
    assert len(allowed[0]) == len(allowed[1]) == 384 * 32  # up to the end token: free
    assert brace in allowed[2] and word not in allowed[2]  # the answer must open an object
    assert '"' in tokenizer.decode(sorted(allowed[3])[:400])  # after "{": keys
    assert guide.advance(word) is None and guide.advance(think_end) is None
    assert _allowed_ids(guide.masks())[0] == allowed[2]
    assert guide.advance(word) is FinishReason.ERROR


def test_masked_verification_emits_only_allowed_tokens_and_matches_masked_greedy():
    """The worker masks every verified slot's logits; greedy verification then equals plain greedy
    decoding under the same masks, and rejection sampling never emits a disallowed token."""
    from moemesh.services.attention.sampling import verify

    generator = torch.Generator().manual_seed(3)
    num_vocab, num_drafts = 64, 3
    for trial in range(20):
        logits = torch.randn(2, num_drafts + 1, num_vocab, generator=generator) * 3  # [B, W1, V]
        allowed = torch.rand(2, num_drafts + 1, num_vocab, generator=generator) < 0.3
        allowed[..., trial % num_vocab] = True
        masks = pack_token_masks(allowed.view(-1, num_vocab))
        flat = apply_token_masks(logits.view(-1, num_vocab), masks, list(range(8)), list(range(8)))
        masked = flat.view(2, num_drafts + 1, num_vocab)
        greedy_path = masked[0].argmax(dim=-1)  # [W1]: drafts equal to masked greedy are accepted
        drafts = torch.stack([greedy_path[:num_drafts], torch.randint(0, num_vocab, (num_drafts,), generator=generator)])
        draft_probs = torch.full((2, num_drafts, num_vocab), 1.0 / num_vocab)
        params = [SamplingParams(), SamplingParams(temperature=1.0)]
        out = verify(masked, drafts, draft_probs, params, [None, 100 + trial], [0, 0], [[1], [1]], [[], []])
        assert out.num_accepted[0] == num_drafts and out.emitted_token_ids[0] == greedy_path.tolist()
        for k, token_id in enumerate(out.emitted_token_ids[1]):
            assert allowed[1, k, token_id], (trial, k, token_id)


def test_worker_refuses_mask_rows_a_plan_does_not_carry():
    from moemesh.services.attention.step_sampling import token_mask_problem

    def seq(row, drafts=(), do_sample=True):
        return m.ScheduledSequence("r", 0, (5, *drafts), 3, ((0,),), do_sample, draft_token_ids=drafts,
                                   token_mask_row=row)

    masks = torch.zeros(3, 4, dtype=torch.int32)
    assert token_mask_problem(seq(None), None) is None
    assert token_mask_problem(seq(1, (7,)), masks) is None  # rows 1 and 2
    assert "outside" in token_mask_problem(seq(2, (7,)), masks)
    assert token_mask_problem(seq(0), None) is not None
    assert token_mask_problem(seq(0, do_sample=False), masks) is not None
    assert token_mask_problem(seq(0), masks.to(torch.int64)) is not None
