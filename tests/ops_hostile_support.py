"""The gateway with a bookkeeping in-test engine, run as a child process for the hostile
connection and input tests: `python tests/ops_hostile_support.py PORT [MAX_MODEL_LEN]`
(`ledger_gateway` starts one and waits for its /health).

`LedgerEngine` is `router_support.ScriptedEngine` plus the resources a real engine holds per
request: KV "blocks" taken from a fixed pool when a request is admitted and returned when its
stream ends for any reason (finished, aborted, or closed by the gateway after a disconnect).
`GET /_test/ledger` reports the open requests and held blocks, so the test can check that a
flood of dropped connections leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # router_support, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

from router_support import ScriptedEngine, tiny_tokenizer  # noqa: E402

NUM_POOL_BLOCKS = 100_000
BLOCKS_PER_REQUEST = 4


class LedgerEngine(ScriptedEngine):
    """Invariant: a request id is in `open_request_ids` and owns blocks exactly while its event
    stream is alive; `num_free_blocks + num_held_blocks == NUM_POOL_BLOCKS` always."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.free_block_ids = list(range(NUM_POOL_BLOCKS))
        self.held_block_ids: dict[str, list[int]] = {}
        self.num_streams_started = 0
        self.num_streams_closed = 0

    async def submit(self, request):
        stream = await super().submit(request)
        block_ids = [self.free_block_ids.pop() for _ in range(BLOCKS_PER_REQUEST)]
        self.held_block_ids[request.request_id] = block_ids
        self.num_streams_started += 1
        return self._ledgered(request.request_id, stream)

    async def _ledgered(self, request_id: str, stream: AsyncIterator) -> AsyncIterator:
        try:
            async for event in stream:
                yield event
        finally:
            self.free_block_ids.extend(self.held_block_ids.pop(request_id, ()))
            self.num_streams_closed += 1

    def ledger(self) -> dict:
        return {"open_request_ids": sorted(self.held_block_ids),
                "num_held_blocks": sum(len(ids) for ids in self.held_block_ids.values()),
                "num_free_blocks": len(self.free_block_ids),
                "num_streams_started": self.num_streams_started,
                "num_streams_closed": self.num_streams_closed,
                "num_aborted": len(self.aborted)}


def build_ledger_app(step_delay_s: float, max_model_len: int = 512):
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from moemesh.common.chat import tokens as tk
    from moemesh.services.router.app import build_app
    from moemesh.services.router.gateway_config import GatewayConfig

    tokenizer = tiny_tokenizer()
    eos = tokenizer.token_to_id(tk.EOS)
    script = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False).ids
    engine = LedgerEngine(script, eos_id=eos, step_delay_s=step_delay_s)
    config = GatewayConfig(model_name="dsv4-flash", max_model_len=max_model_len, eos_token_ids=(eos,),
                           keep_alive_interval_s=0.5)
    app = build_app(config, engine, tokenizer)

    async def ledger(_):
        return JSONResponse(engine.ledger())

    app.router.routes.insert(0, Route("/_test/ledger", ledger))
    return app


@contextlib.contextmanager
def ledger_gateway(stderr_path: Path, max_model_len: int = 512) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, base URL) of a ledger gateway child process, once its /health answers."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, __file__, str(port), str(max_model_len)],
                                   stdout=stderr, stderr=stderr)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "gateway did not come up"
            time.sleep(0.1)
        yield process, base_url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _main(port: int, max_model_len: int) -> int:
    import uvicorn

    uvicorn.run(build_ledger_app(step_delay_s=0.05, max_model_len=max_model_len), host="127.0.0.1", port=port,
                loop="uvloop", log_level="warning", timeout_keep_alive=2, backlog=4096)
    return 0


if __name__ == "__main__":
    sys.exit(_main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 512))
