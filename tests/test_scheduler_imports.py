"""The scheduler package is plain Python: importing and running it loads no torch, zmq or asyncio."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    BLOCKED = ("torch", "zmq", "asyncio")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} must not be imported by the scheduler")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, "tests")  # the simulated engine is a test helper
    import moemesh.services.router.scheduler as package
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"moemesh.services.router.scheduler.{module.name}")
    from moemesh.common.sampling_params import SamplingParams
    from moemesh.services.router.scheduler import Request, Scheduler, SchedulerConfig
    from sim_engine_support import SimulatedEngine, oracle_drafter
    engine = SimulatedEngine(Scheduler(SchedulerConfig(num_gpu_blocks=4, max_model_len=512)), drafter=oracle_drafter(2))
    engine.add(Request("r", tuple(range(300)), SamplingParams(max_tokens=20)))
    engine.run_until_done(max_steps=100)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    print("LOADED", loaded)
    """
)


def test_scheduler_imports_no_torch_zmq_or_asyncio():
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    assert "LOADED []" in completed.stdout
