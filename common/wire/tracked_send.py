"""A multipart message whose tracker covers EVERY frame that may alias a reusable buffer.

Why this exists (a staging buffer could be overwritten while queued): pyzmq's `send_multipart(parts, copy=False,
track=True)` sends part by part and returns only the LAST part's MessageTracker, and a part
smaller than `copy_threshold` (zmq.COPY_THRESHOLD, 64 KiB) is copied on the spot and gets an
already finished tracker. A staged Dispatch of 43 tokens or more is `[header, hidden (big),
expert_ids, weights (small, yet too big to travel inline in the header)]`, so the tracker said
"done" while `hidden` was still queued in libzmq, and the staging pool handed its buffer to the
next message, which overwrote it before the I/O thread sent it.

The mechanism this relies on (pyzmq 27, `zmq/backend/cython/_zmq.py`): a zero-copy `zmq.Frame`
owns one reference to a libzmq message whose data is our buffer; sending it sends a
reference-counted copy (`Frame.fast_copy`), so the data is released -- the free callback runs
and, via pyzmq's gc thread, the Frame's tracker event is set -- only once libzmq has sent it AND
the Python Frame itself is gone. That is also why wrapping parts in Frames can look like a hang:
a caller that keeps its Frame list (a local, a traceback, a queued asyncio send) keeps every
tracker pending forever. `TrackedMessage` therefore drops its Frames as soon as the send call
returns or fails (`send`/`send_async` clear the list in `finally`).

Invariant: `tracker.done` implies no Frame, ours or libzmq's, references the buffers any more, so
a staging lease may be handed back with this tracker at any point after construction, even before
sending; small parts are copied at construction (their tracker is finished at once, correctly).
`bytes` parts (headers, envelopes, peer ids) are immutable and passed through untracked.

Works for sync and asyncio sockets and every transport: the frames go out in one
`send_multipart` call, so an asyncio send queued behind the high-water mark stays one message
(never interleaved part by part with another coroutine's), and for inproc:// the tracker stays
pending until the receiver drops the received frames, which share our buffer.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import zmq


class TrackedMessage:
    """One message's parts as zmq Frames, plus one tracker over all zero-copy ones.

    Send it once with `send` (sync socket) or `send_async` (zmq.asyncio socket); after that, or
    after a failed send, it holds no Frame. `num_zero_copy_frames` counts the tracked frames.
    """

    def __init__(self, parts: Sequence[Any], copy_threshold: int = zmq.COPY_THRESHOLD) -> None:
        frames: list[Any] = []
        trackers = []
        for part in parts:
            if type(part) is bytes:
                frames.append(part)  # immutable: nothing can overwrite it while queued
                continue
            if memoryview(part).nbytes < copy_threshold:
                frames.append(zmq.Frame(part, copy=True))  # copied now: the buffer may change after this
                continue
            frame = zmq.Frame(part, copy=False, track=True)
            trackers.append(frame.tracker)
            frames.append(frame)
        self._frames: list[Any] | None = frames
        self.num_zero_copy_frames = len(trackers)
        # The trackers hold only threading Events, never the Frames, so holding this tracker does
        # not keep the buffers referenced.
        self.tracker = zmq.MessageTracker(*trackers)

    def _take_frames(self) -> list[Any]:
        if self._frames is None:
            raise RuntimeError("a TrackedMessage is sent once")
        frames, self._frames = self._frames, None
        return frames

    def send(self, socket: zmq.Socket, flags: int = 0) -> zmq.MessageTracker:
        """Send on a blocking socket; returns `tracker`."""
        frames = self._take_frames()
        try:
            socket.send_multipart(frames, flags, copy=False)
        except BaseException as error:
            _forget_frames(error)
            raise
        finally:
            frames.clear()  # a traceback must not keep the Frames (and so the buffers) alive
        return self.tracker

    async def send_async(self, socket: Any, flags: int = 0) -> zmq.MessageTracker:
        """Send on a zmq.asyncio socket; returns `tracker`. If the await is cancelled while the
        send is still queued, the queued send is dropped with its future and the Frames with it."""
        frames = self._take_frames()
        try:
            await socket.send_multipart(frames, flags, copy=False)
        except BaseException as error:
            _forget_frames(error)
            raise
        finally:
            frames.clear()
        return self.tracker

    def discard(self) -> None:
        """Drop the Frames without sending (an error between building and sending)."""
        if self._frames is not None:
            self._take_frames().clear()


def _forget_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in `error`'s traceback: pyzmq's `send_multipart`
    and `send` frames hold the Frame being sent (`msg`, `data`), and an exception kept by a
    caller (or chained as __context__ of the next one) would keep that buffer pending forever.
    Only locals of frames that already returned are cleared; the traceback's lines stay."""
    traceback.clear_frames(error.__traceback__)
