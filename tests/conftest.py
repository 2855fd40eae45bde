"""Suite-wide fixtures, and the work units of a parallel run.

`make test` runs the suite on pytest-xdist workers with `--dist loadfile
--no-loadscope-reorder`: a module's tests run on one worker, one after another, so its
module-scoped fixtures (servers, clusters, checkpoints) start once. The modules in
`FIRST_MODULES` are handed out first, so the longest ones are not left for the end while the
other worker idles. System tests take free ports and
keep their sockets and files under their own tmp dirs, so modules on different workers do not
meet.

Idle OpenMP threads sleep (`OMP_WAIT_POLICY=PASSIVE`, set here before torch loads, so this
process and every service a test starts inherit it): by default each torch process's intra-op
threads spin-wait after every parallel region, and a served model runs four or five such
processes per worker. On a 2-core host the spinning threads of one worker's services take the
cores the other worker's services wait for, and every step runs several times slower. The
policy changes how an idle thread waits, not how many threads compute or what they compute; a
value already in the environment is kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import structlog  # noqa: E402

# The longest modules on a 2-core machine, longest first (measured with `--durations`); a module
# missing here only starts later.
FIRST_MODULES = (
    "test_spec_serve.py",
    "test_e2e_serve.py",
    "test_ops_serve_restart.py",
    "test_ops_fault_recovery.py",
    "test_guided_serve.py",
    "test_ops_replica_serve.py",
    "test_spec_distribution.py",
    "test_attention_boundary_kernels.py",
    "test_spec_drafter_death.py",
    "test_long_context_oracle.py",
    "test_ops_hostile_connections.py",
    "test_kernels_mhc_model.py",
    "test_distributed_generate.py",
    "test_kernels_interpret.py",
    "test_kernels_drift.py",
    "test_live_placement_serve.py",
    "test_ops_netns.py",
    "test_dspark_fused_glue.py",
    "test_ops_supervisor.py",
    "test_ops_hostile_workers.py",
    "test_kernels_attention.py",
    "test_bench_fullsize.py",
    "test_serve_options.py",
    "test_random_checkpoint.py",
    "test_kernels_cpu_mailbox.py",
)


@pytest.fixture(autouse=True)
def _fresh_structlog():
    """Commands run in-process (`moemesh generate`, services) configure structlog globally, e.g.
    with a warning-level filter; restore the defaults so no test sees another test's configuration."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def open_workers():
    """A list a test appends the in-process attention workers it builds to; each is closed afterwards."""
    import asyncio

    workers: list = []
    yield workers
    for worker in workers:
        asyncio.run(worker.close())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank_of_module = {name: rank for rank, name in enumerate(FIRST_MODULES)}
    # a stable sort: modules keep their own order of tests
    items.sort(key=lambda item: rank_of_module.get(item.path.name, len(FIRST_MODULES)))
