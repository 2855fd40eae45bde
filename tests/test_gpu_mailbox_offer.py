"""The GPU expert mailbox's host-side pieces that run anywhere: the offer on the wire (a device region's CUDA
IPC description), the expert side's refusals before any CUDA work (no device region, another host), and the
row buckets a worker captures. The device protocol itself runs in tests/test_mailbox_step_graph_cuda.py."""

from __future__ import annotations

import torch

from moemesh.common.wire import codec
from moemesh.common.wire.cuda_ipc import host_identity
from moemesh.common.wire.messages import AttachMailbox, MailboxAttached, SharedCudaBuffer
from moemesh.services.expert.gpu_mailbox import row_buckets
from moemesh.services.expert.mailbox_plane import ExpertMailboxes


def _offer(**fields) -> AttachMailbox:
    return AttachMailbox(**{"channel_id": "attention-0/1", "host_id": host_identity(), "segment_path": "/dev/shm/x",
                            "owned_layers": (0, 0, 1), "owned_experts": (3, 5, 3), **fields})


def test_an_offer_with_a_device_region_crosses_the_wire_whole():
    region = SharedCudaBuffer(device_index=0, handle=b"\x01" * 64, storage_size_bytes=1 << 20, storage_offset_bytes=0,
                              ref_counter_handle=b"ref", ref_counter_offset=8, event_handle=b"", event_sync_required=False,
                              tensor_offset=0, num_bytes=3 << 18)
    for message in (_offer(device_region=region, timeout_s=1.5), _offer(),
                    MailboxAttached(channel_id="attention-0/1", accepted=True, pid=42, on_device=True)):
        assert codec.decode(codec.encode(message)) == message


def test_a_gpu_worker_refuses_an_offer_without_a_device_region_or_from_another_host():
    mailboxes = ExpertMailboxes(torch.device("cuda:0"), "expert-gpu")  # refusals come before any CUDA call
    refused = mailboxes.attach(_offer(), holdings=None, num_layers=2, num_experts=8, swiglu_limit=None,
                               route_before_w2=False, num_threads=1)
    assert refused == MailboxAttached(channel_id="attention-0/1", accepted=False, reason=refused.reason)
    assert "no device region" in refused.reason
    elsewhere = mailboxes.attach(_offer(host_id="another-host"), holdings=None, num_layers=2, num_experts=8,
                                 swiglu_limit=None, route_before_w2=False, num_threads=1)
    assert not elsewhere.accepted and "is not this host" in elsewhere.reason


def test_row_buckets_cover_every_row_count_up_to_the_mailbox():
    assert row_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert row_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert row_buckets(1) == (1,)
    for rows in range(1, 49):  # the worker replays the smallest bucket that holds the posted rows
        bucket = min(b for b in row_buckets(48) if b >= rows)
        assert bucket < 2 * rows or bucket == 1  # never more than twice the rows computed
