"""Helpers for the dispatch-staging and routing-statistics tests: a tiny FP8/FP4 checkpoint and
real `ExpertWorker`s served from threads over real ipc sockets (no processes: fast to start).

`ThreadedExpert` is the expert side of the data path as the service runner does it: decode the
Dispatch, `handle_dispatch`, send the Combine from the worker's `reply_staging` pool (or from
its own tensors when the worker says the reply does not fit a buffer).
"""

from __future__ import annotations

import threading
from pathlib import Path

import zmq

from moemesh.common.wire import codec
from moemesh.common.wire.messages import Dispatch
from moemesh.common.wire.staging import send_staged
from moemesh.common.wire.transport import Kind, pack_envelope, unpack_envelope


def write_tiny_checkpoint(path: Path, seed: int = 5):
    from moemesh.common.checkpoint.writer import write_checkpoint
    from tiny_checkpoint_support import random_hub_state_dict, tiny_config

    config = tiny_config(num_experts_per_tok=4)
    write_checkpoint(path, config, random_hub_state_dict(config, seed=seed, include_mtp=False))
    return config


def expert_worker(checkpoint: Path, name: str = "expert-t", **config_fields):
    """An ExpertWorker holding every (layer, expert) pair of the checkpoint, staging allocated."""
    from moemesh.common.model.config import ModelConfig
    from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

    model_config = ModelConfig.load(str(checkpoint))
    pairs = tuple((l, e) for l in range(model_config.num_hidden_layers) for e in range(model_config.n_routed_experts))
    worker = ExpertWorker(ExpertWorkerConfig(name=name, checkpoint_path=str(checkpoint), pairs=pairs, **config_fields),
                          model_config)
    worker.allocate_staging()
    worker.load_pairs(pairs, str(checkpoint))
    return worker


class ThreadedExpert:
    """Serves `worker` on a ROUTER bound at `endpoint` from a thread until `stop()`."""

    def __init__(self, worker, endpoint: str, context: zmq.Context) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.context = context
        self.num_staged_replies = 0
        self.received_dispatches: list[Dispatch] = []  # copies, for tests that check what arrived
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> "ThreadedExpert":
        self._thread.start()
        if not self._bound.wait(10):
            raise RuntimeError(f"{self.endpoint} was not bound")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _serve(self) -> None:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.endpoint)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not socket.poll(20, zmq.POLLIN):
                    continue
                peer, envelope, *frames = socket.recv_multipart(copy=False)
                _, correlation_id = unpack_envelope(envelope)
                dispatch = codec.decode(frames, accept=(Dispatch,))
                self.received_dispatches.append(Dispatch(
                    dispatch_id=dispatch.dispatch_id, step_id=dispatch.step_id, layer=dispatch.layer,
                    micro_batch=dispatch.micro_batch, hidden=dispatch.hidden.clone(),
                    expert_ids=dispatch.expert_ids.clone(), weights=dispatch.weights.clone(),
                    per_expert_outputs=dispatch.per_expert_outputs,
                    slot_mask=None if dispatch.slot_mask is None else dispatch.slot_mask.clone()))
                reply = self.worker.handle_dispatch(dispatch)
                prefix = (peer.bytes, pack_envelope(Kind.REPLY, correlation_id))
                pool = self.worker.reply_staging
                if pool is None:
                    socket.send_multipart([*prefix, *codec.encode(reply)], copy=False)
                else:
                    send_staged(socket, pool, lambda writer: codec.encode(reply, tensor_writer=writer), prefix=prefix)
                    self.num_staged_replies += 1
        finally:
            socket.close(linger=0)
