"""Codec: every message type round-trips; malformed, unknown or oversized input is a WireError."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.common.wire.errors import WireError
from moemesh.common.wire.schema import WireLimits
from wire_support import assert_same_message, sample_messages

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_samples_cover_every_message_type_and_tags_are_unique():
    assert {type(message) for message in sample_messages()} == set(m.MESSAGE_TYPES.values())
    assert len(m.MESSAGE_TYPES) == len(m.ALL_MESSAGES)


@pytest.mark.parametrize("message", sample_messages(), ids=lambda message: type(message).TYPE)
def test_every_message_round_trips(message):
    frames = codec.encode(message)
    decoded = codec.decode([bytes(frame) for frame in frames])
    assert_same_message(decoded, message)


def test_large_tensors_travel_as_frames_small_ones_inline():
    small = m.Combine(dispatch_id=1, step_id=0, layer=0, micro_batch=0, output=torch.ones(2, 4))
    large = m.Combine(dispatch_id=1, step_id=0, layer=0, micro_batch=0, output=torch.ones(64, 4096, dtype=torch.bfloat16))
    assert len(codec.encode(small)) == 1
    frames = codec.encode(large)
    assert len(frames) == 2 and len(frames[1]) == 64 * 4096 * 2


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64,
              torch.uint8, torch.int8, torch.float8_e4m3fn, torch.bool],
)
def test_every_whitelisted_dtype_round_trips(dtype):
    values = (torch.arange(-600, 600) % 7).reshape(3, 20, 20).to(dtype)
    message = m.TargetFeatures(step_id=0, segments=(), features=values)
    decoded = codec.decode(codec.encode(message))
    assert decoded.features.dtype == dtype
    assert torch.equal(decoded.features.view(torch.uint8), values.view(torch.uint8))


def test_non_contiguous_and_empty_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    message = m.TargetFeatures(step_id=0, segments=(), features=base.t())
    assert torch.equal(codec.decode(codec.encode(message)).features, base.t())
    empty = m.TargetFeatures(step_id=0, segments=(), features=torch.empty(0, 4096, dtype=torch.bfloat16))
    assert codec.decode(codec.encode(empty)).features.shape == (0, 4096)


def test_disallowed_dtype_is_refused_at_encode():
    message = m.TargetFeatures(step_id=0, segments=(), features=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="not allowed"):
        codec.encode(message)


def _header(tag, fields, version=m.PROTOCOL_VERSION):
    return msgpack.packb([tag, version, fields], use_bin_type=True)


def _combine_fields(descriptor):
    return {"dispatch_id": 1, "step_id": 0, "layer": 0, "micro_batch": 0, "output": descriptor}


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([], "empty"),
        ([b"\xc1garbage"], "msgpack"),
        ([_header("nope", {})], "unknown message type"),
        ([_header("ping", {"nonce": 1}, version=99)], "version"),
        ([_header("ping", {"nonce": "1"})], "expected int"),
        ([_header("ping", {"nonce": True})], "expected int"),
        ([_header("ping", {})], "missing"),
        ([_header("ping", {"nonce": 1, "extra": 2})], "unknown fields"),
        ([_header("heartbeat", {"name": "a", "role": "wizard", "state": "ready", "sequence": 1})], "not a ServiceRole"),
        ([_header("combine", _combine_fields(["f64", [2], 0])), b"x" * 16], "not allowed"),
        ([_header("combine", _combine_fields(["f32", [-1, 2], 0])), b""], "non-negative"),
        ([_header("combine", _combine_fields(["f32", [4], 0])), b"x" * 15], "needs 16"),
        ([_header("combine", _combine_fields(["f32", [4], 1])), b"x" * 16], "frame reference"),
        ([_header("combine", _combine_fields(["f32", [1] * 9, 0])), b"x" * 4], "shape"),
        ([_header("combine", _combine_fields(["f32", [2**40, 2**40], 0])), b""], "exceeds"),
        ([_header("ping", {"nonce": 1}), b"stray"], "not referenced"),
        ([_header("step_result", {"step_id": 1, "sequences": [{"request_id": 5, "token_ids": []}]})], "expected str"),
    ],
)
def test_malformed_messages_raise_wire_error(frames, reason):
    with pytest.raises(WireError, match=reason):
        codec.decode(frames)


def test_limits_bound_total_size_and_frame_count():
    large = m.Combine(dispatch_id=1, step_id=0, layer=0, micro_batch=0, output=torch.zeros(1024, 1024))
    frames = codec.encode(large)
    with pytest.raises(WireError, match="exceeds"):
        codec.decode(frames, limits=WireLimits(max_message_bytes=1 << 20))
    with pytest.raises(WireError, match="frames exceed"):
        codec.decode([frames[0]] + [b""] * 65)
    long_plan = m.StepPlan(step_id=0, sequences=(), free_seq_slots=tuple(range(100)))
    with pytest.raises(WireError, match="items exceed"):
        codec.decode(codec.encode(long_plan), limits=WireLimits(max_items=50))


def test_accept_refuses_types_before_touching_tensors():
    frames = codec.encode(next(x for x in sample_messages() if isinstance(x, m.Dispatch)))
    with pytest.raises(WireError, match="not accepted"):
        codec.decode(frames, accept=codec.TORCH_FREE_MESSAGES)


def test_router_side_codec_does_not_import_torch():
    script = (
        "import sys\n"
        "from moemesh.common.wire import codec, messages as m\n"
        "from moemesh.common.wire import transport\n"
        "from moemesh.common.runtime import service, supervisor, deployment, logging\n"
        "plan = m.StepPlan(step_id=1, sequences=(m.ScheduledSequence('r', 0, (1,), 0, ((0,),), True),))\n"
        "assert codec.decode(codec.encode(plan), accept=codec.TORCH_FREE_MESSAGES) == plan\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_scalar_sequences_keep_their_values_and_name_a_bad_element():
    """tuple[int, ...] / tuple[float, ...] fields are checked in one pass; ints in a float sequence arrive as
    floats, a float32 value survives exactly, and a bad element is still refused by its index."""
    proposal = m.DraftProposal(request_id="r", token_ids=(3, 9), draft_probs=(0.25, 1), confidences=(0.5, 0.75),
                               support_token_ids=((1, 3), (9,)), support_probs=((0.1, 0.9), (1.0,)))
    decoded = codec.decode(codec.encode(m.DraftTokens(step_id=1, proposals=(proposal,)))).proposals[0]
    assert decoded.draft_probs == (0.25, 1.0) and type(decoded.draft_probs[1]) is float
    assert decoded.support_token_ids == ((1, 3), (9,)) and decoded.support_probs == ((0.1, 0.9), (1.0,))
    value = float(torch.tensor(0.1, dtype=torch.float32))
    assert codec.decode(codec.encode(m.DraftTokens(step_id=1, proposals=(
        dataclasses.replace(proposal, support_probs=((value, 0.9), (1.0,))),)))).proposals[0].support_probs[0][0] == value
    bad = {"request_id": "r", "token_ids": [3, True], "draft_probs": [], "confidences": []}
    with pytest.raises(WireError, match=r"proposals\[0\]\.token_ids\[1\]: expected int"):
        codec.decode([_header("draft_tokens", {"step_id": 1, "proposals": [bad]})])
    with pytest.raises(WireError, match=r"draft_probs\[0\]: expected float"):
        codec.decode([_header("draft_tokens", {"step_id": 1, "proposals": [{**bad, "token_ids": [],
                                                                              "draft_probs": ["x"]}]})])
    with pytest.raises(WireError, match=r"token_ids\[1\]: expected int"):
        codec.encode(m.DraftTokens(step_id=1, proposals=(dataclasses.replace(proposal, token_ids=(3, 9.0)),)))
