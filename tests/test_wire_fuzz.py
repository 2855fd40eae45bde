"""Hypothesis-fuzzed headers and frames sent to a running receive loop over a real socket:
it never crashes, answers every request whose envelope is readable, and still serves a
valid request afterwards."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.common.wire.transport import Kind, SyncClient, pack_envelope, unpack_envelope
from wire_support import EchoServerThread, sample_messages

FUZZ_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
tensor_descriptors = st.lists(
    st.one_of(
        st.sampled_from(["bf16", "f32", "i32", "f64", "bool", ""]),
        st.lists(st.integers(-2, 2**33), max_size=10),
        st.integers(-1, 3) | st.binary(max_size=16),
    ),
    min_size=0, max_size=4,
)


@st.composite
def typed_headers(draw):
    """Headers that look right (known tag, current version) with fields drawn to be almost right."""
    tag = draw(st.sampled_from(sorted(m.MESSAGE_TYPES)) | st.text(max_size=10))
    version = draw(st.just(m.PROTOCOL_VERSION) | st.integers(-5, 5) | plain_values)
    names = draw(st.lists(st.sampled_from(["nonce", "name", "step_id", "sequences", "output", "hidden",
                                            "dispatch_id", "layer", "micro_batch", "expert_ids", "weights",
                                            "features", "segments", "role", "state", "x"]), max_size=8))
    fields = {name: draw(plain_values | tensor_descriptors) for name in names}
    shape = draw(st.sampled_from(["list", "short", "map"]))
    body = {"list": [tag, version, fields], "short": [tag, version], "map": {"t": tag}}[shape]
    return msgpack.packb(body, use_bin_type=True)


@st.composite
def mutated_messages(draw):
    """A valid encoded sample with one byte flipped or the header truncated."""
    message = draw(st.sampled_from(SAMPLES))
    frames = [bytes(frame) for frame in codec.encode(message)]
    index = draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    if frame and draw(st.booleans()):
        position = draw(st.integers(0, len(frame) - 1))
        frame[position] ^= draw(st.integers(1, 255))
    else:
        frame = frame[: draw(st.integers(0, len(frame)))]
    frames[index] = bytes(frame)
    return frames


SAMPLES = sample_messages()

message_frames = st.one_of(
    st.lists(st.binary(max_size=64), min_size=0, max_size=4),
    st.tuples(typed_headers(), st.lists(st.binary(max_size=64), max_size=3)).map(lambda t: [t[0], *t[1]]),
    mutated_messages(),
)


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    with EchoServerThread(f"ipc://{tmp_path_factory.mktemp('fuzz')}/fuzz.sock") as server:
        yield server


@pytest.fixture(scope="module")
def raw_socket(echo_server):
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(echo_server.endpoint)
    yield socket
    socket.close(0)
    context.term()


@FUZZ_SETTINGS
@given(frames=message_frames, correlation_id=st.integers(0, 2**64 - 1))
def test_fuzzed_requests_are_answered_and_never_crash_the_loop(echo_server, raw_socket, frames, correlation_id):
    raw_socket.send_multipart([pack_envelope(Kind.REQUEST, correlation_id), *frames])
    assert raw_socket.poll(2000), "the receive loop did not answer a request with a readable envelope"
    reply = raw_socket.recv_multipart()
    assert unpack_envelope(reply[0]) == (Kind.REPLY, correlation_id)
    codec.decode(reply[1:])  # the reply itself is always well-formed


@FUZZ_SETTINGS
@given(envelope=st.binary(max_size=12), frames=message_frames)
def test_fuzzed_envelopes_are_dropped(echo_server, raw_socket, envelope, frames):
    raw_socket.send_multipart([envelope, *frames])


def test_loop_still_serves_after_fuzzing(echo_server, raw_socket):
    while raw_socket.poll(200):  # replies to fuzzed messages with an accidentally valid envelope
        raw_socket.recv_multipart()
    context = zmq.Context()
    client = SyncClient(echo_server.endpoint, context=context)
    assert client.request(m.Ping(nonce=42), timeout_s=5) == m.Pong(nonce=42, name="echo")
    assert echo_server.server.num_dropped > 0
    client.close()
    context.term()
