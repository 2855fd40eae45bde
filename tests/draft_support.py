"""Shared by the tests that run the draft worker as a real process: the smallest deployment file
that names one attention worker, one expert worker and the draft worker, and the draft worker
started from it under a supervisor that waits for its Ready."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# what `moemesh draft --config FILE` runs, without the CLI's argument parsing
DRAFT_CHILD = ("import sys; from moemesh.common.runtime.deployment import load_deployment; "
               "from moemesh.services.draft.main import run; sys.exit(run(load_deployment(sys.argv[1]), None, 'info'))")


def write_draft_deployment(run_dir: Path, model_path: Path | str) -> Path:
    """deploy.toml in `run_dir` (logs under run_dir/logs) serving `model_path`; returns its path."""
    config_path = Path(run_dir) / "deploy.toml"
    config_path.write_text(f"""
[model]
path = "{model_path}"
[paths]
run_dir = "{run_dir}"
log_dir = "{Path(run_dir) / 'logs'}"
[[attention]]
name = "attention-0"
[[expert]]
name = "expert-0"
[draft]
enabled = true
name = "draft"
""")
    return config_path


@asynccontextmanager
async def running_draft_worker(config_path: Path, *, ready_timeout_s: float = 60.0):
    """(context, endpoints, client, ready, child): the draft worker process of `config_path`, Ready.
    Always kills the child, closes the client and the supervisor, and terminates the context."""
    import zmq.asyncio

    from moemesh.common.runtime.deployment import derive_endpoints, load_deployment
    from moemesh.common.runtime.supervisor import Supervisor
    from moemesh.common.wire.transport import AsyncClient

    endpoints = derive_endpoints(load_deployment(config_path))
    context = zmq.asyncio.Context()
    supervisor = Supervisor(endpoints.supervisor, context=context)
    supervisor_task = asyncio.create_task(supervisor.run())
    child = subprocess.Popen([sys.executable, "-c", DRAFT_CHILD, str(config_path)], cwd=REPO_ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = AsyncClient(endpoints.draft, context=context, default_timeout_s=20)
    try:
        ready = await supervisor.wait_ready(["draft"], timeout_s=ready_timeout_s)
        yield context, endpoints, client, ready, child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        await client.close()
        supervisor_task.cancel()
        supervisor.close()
        context.term()
