"""Hostile wire input sent straight to real worker processes: hypothesis-generated multipart
ZeroMQ messages (random frames, plausible headers with wrong fields, valid encodings with one
byte flipped or cut short, valid messages with hostile contents) go to the ROUTER socket of a
real expert worker process and of a real attention worker process (`LocalCluster`, tiny random
checkpoint), and of a real draft worker process (the default model's drafter). None may crash;
each still answers a valid Ping afterwards, and then still stops cleanly (exit code 0) on SIGTERM.

Drain and Shutdown are left out: a valid one is an operator's order, and obeying it is not a
crash. WriteRoutingStats is left out too: a valid one writes files at the path it names.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moemesh.common.wire import codec
from moemesh.common.wire import messages as m
from moemesh.common.wire.transport import Kind, SyncClient, pack_envelope
from wire_support import sample_messages

pytestmark = pytest.mark.timeout(240)
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "kjv-dsv4-mini"

CONTROL_TAGS = {"Drain", "Shutdown", "WriteRoutingStats"}
SAFE_SAMPLES = [message for message in sample_messages() if type(message).__name__ not in CONTROL_TAGS]
FUZZ_SETTINGS = settings(max_examples=150, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=16),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)


@st.composite
def typed_headers(draw):
    """A header with a real (non-control) tag and the current version, but fields drawn at random."""
    tags = sorted(tag for tag, cls in m.MESSAGE_TYPES.items() if cls.__name__ not in CONTROL_TAGS)
    tag = draw(st.sampled_from(tags))
    names = draw(st.lists(st.sampled_from(["nonce", "step_id", "sequences", "hidden", "dispatch_id", "layer",
                                           "micro_batch", "expert_ids", "weights", "experts", "path", "x"]),
                          max_size=6))
    fields = {name: draw(plain_values) for name in names}
    return msgpack.packb([tag, m.PROTOCOL_VERSION, fields], use_bin_type=True)


@st.composite
def mutated_messages(draw):
    """A valid encoding of a sample with one byte flipped, or one frame cut short, or intact."""
    frames = [bytes(frame) for frame in codec.encode(draw(st.sampled_from(SAFE_SAMPLES)))]
    index = draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    action = draw(st.sampled_from(["flip", "cut", "keep"]))
    if action == "flip" and frame:
        frame[draw(st.integers(0, len(frame) - 1))] ^= draw(st.integers(1, 255))
    elif action == "cut":
        frame = frame[: draw(st.integers(0, len(frame)))]
    frames[index] = bytes(frame)
    return frames


message_frames = st.one_of(
    st.lists(st.binary(max_size=64), max_size=4),
    st.tuples(typed_headers(), st.lists(st.binary(max_size=64), max_size=3)).map(lambda t: [t[0], *t[1]]),
    mutated_messages(),
)
envelopes = st.one_of(st.binary(max_size=12),
                      st.builds(pack_envelope, st.sampled_from(list(Kind)), st.integers(0, 2**64 - 1)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from moemesh.common.checkpoint.writer import write_checkpoint
    from tiny_checkpoint_support import random_hub_state_dict, tiny_config
    from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster

    config = tiny_config()
    path = tmp_path_factory.mktemp("fuzz_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=5, include_mtp=False))
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("fuzz_run")), num_expert_workers=1,
                       placement="all", ready_timeout_s=120, stop_timeout_s=20)
    with LocalCluster(spec) as running:
        yield running
    assert running.exit_codes == {"attention-0": 0, "expert-0": 0}, running.exit_codes


class DraftProcess:
    """The draft worker (`moemesh draft`) on the default model, whose `mtp.*` blocks it serves,
    run alone from a small deployment file (no supervisor listens: its Ready goes nowhere)."""

    def __init__(self, run_dir: Path) -> None:
        from draft_support import write_draft_deployment

        from moemesh.common.runtime.deployment import derive_endpoints, load_deployment

        config_path = write_draft_deployment(run_dir, DEFAULT_MODEL)
        self.endpoint = derive_endpoints(load_deployment(config_path)).draft
        self.stderr_path = run_dir / "draft.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen([sys.executable, "-m", "moemesh.cli", "draft", "--config", str(config_path)],
                                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr)

    def check_alive(self) -> None:
        assert self.process.poll() is None, self.stderr_path.read_text(errors="replace")[-2000:]

    def endpoint_of(self, name: str) -> str:
        return self.endpoint

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            return -signal.SIGKILL


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    if not any(DEFAULT_MODEL.glob("*.safetensors")):
        pytest.skip("default model weights missing (the draft worker serves its mtp.* blocks)")
    running = DraftProcess(tmp_path_factory.mktemp("fuzz_draft"))
    context = zmq.Context()
    client = SyncClient(running.endpoint, context=context)
    try:
        reply = client.request(m.Ping(nonce=1), timeout_s=120)  # answers once loaded and bound
        assert isinstance(reply, m.Pong), reply
    except BaseException:
        running.stop()
        raise
    finally:
        client.close()
        context.term()
    yield running
    assert running.stop() == 0, running.stderr_path.read_text(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def raw_sockets(cluster):
    context = zmq.Context()
    sockets = {}
    for name in ("expert-0", "attention-0"):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(cluster.endpoint_of(name))
        sockets[name] = socket
    yield sockets
    for socket in sockets.values():
        socket.close(0)
    context.term()


def _send_and_drain(socket: zmq.Socket, envelope: bytes, frames: list[bytes]) -> None:
    socket.send_multipart([envelope, *frames])
    while socket.poll(20):  # replies to whatever was readable enough to answer
        socket.recv_multipart()


@FUZZ_SETTINGS
@given(envelope=envelopes, frames=message_frames)
def test_fuzzed_messages_to_the_expert_worker(cluster, raw_sockets, envelope, frames):
    _send_and_drain(raw_sockets["expert-0"], envelope, frames)
    cluster.check_alive()


@FUZZ_SETTINGS
@given(envelope=envelopes, frames=message_frames)
def test_fuzzed_messages_to_the_attention_worker(cluster, raw_sockets, envelope, frames):
    _send_and_drain(raw_sockets["attention-0"], envelope, frames)
    cluster.check_alive()


@pytest.fixture(scope="module")
def draft_socket(draft):
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(draft.endpoint)
    yield socket
    socket.close(0)
    context.term()


@FUZZ_SETTINGS
@given(envelope=envelopes, frames=message_frames)
def test_fuzzed_messages_to_the_draft_worker(draft, draft_socket, envelope, frames):
    _send_and_drain(draft_socket, envelope, frames)
    draft.check_alive()


@pytest.mark.parametrize("name", ["expert-0", "attention-0", "draft"])
def test_workers_still_answer_ping_after_fuzzing(request, name):
    if name == "draft":
        owner, socket = request.getfixturevalue("draft"), request.getfixturevalue("draft_socket")
    else:
        owner, socket = request.getfixturevalue("cluster"), request.getfixturevalue("raw_sockets")[name]
    while socket.poll(500):
        socket.recv_multipart()
    owner.check_alive()
    context = zmq.Context()
    client = SyncClient(owner.endpoint_of(name), context=context)
    try:
        reply = client.request(m.Ping(nonce=4242), timeout_s=30)
    finally:
        client.close()
        context.term()
    assert isinstance(reply, m.Pong) and reply.nonce == 4242, reply
