"""`moemesh attention --routing-stats-out FILE` as a real process: the hotness tables are written
on a WriteRoutingStats request and again on SIGTERM (after the drain), and read back with
`common.placement.stats.read_csv`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from moemesh.common.placement.stats import Phase, read_csv
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire.messages import RoutingStatsWritten, StepResult, WriteRoutingStats
from moemesh.common.wire.transport import SyncClient
from dispatch_support import write_tiny_checkpoint
from moemesh.commands.generate_distributed import scheduler_config
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.router.offline_engine import OfflineEngine

_REPO_ROOT = Path(__file__).resolve().parents[1]


def _drive(client: SyncClient, prompts: list[list[int]], max_tokens: int) -> int:
    def execute(plan):
        reply = client.request(plan, timeout_s=60.0)
        assert isinstance(reply, StepResult), reply
        return reply

    engine = OfflineEngine(scheduler_config(128, 256, 0), execute)
    outputs = [engine.add_request(f"req-{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    engine.run()
    return sum(len(o.output_token_ids) for o in outputs)


def test_routing_stats_are_written_on_request_and_on_sigterm(tmp_path):
    model_path = tmp_path / "model"
    config = write_tiny_checkpoint(model_path, seed=3)
    spec = ClusterSpec(model_path=str(model_path), run_dir=str(tmp_path / "run"), num_expert_workers=1,
                       with_attention=False)
    out_path = tmp_path / "stats" / "routing.csv"
    with LocalCluster(spec) as cluster:
        config_path = cluster.run_dir / "deployment.toml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])))
        with open(tmp_path / "attention.stderr", "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "moemesh.cli", "attention", "--config", str(config_path), "--name",
                 cluster.attention_name, "--log-level", "warning", "--routing-stats-out", str(out_path)],
                stdout=stderr, stderr=stderr, env=env, cwd=_REPO_ROOT)
        context = zmq.Context()
        client = SyncClient(cluster.attention_endpoint, context=context)
        try:
            socket_path = Path(cluster.attention_endpoint.removeprefix("ipc://"))
            deadline = time.monotonic() + 120
            while not socket_path.exists():
                assert process.poll() is None, (tmp_path / "attention.stderr").read_text()[-2000:]
                assert time.monotonic() < deadline
                time.sleep(0.05)
            _drive(client, [[5, 9, 17, 4], [30, 31, 32]], max_tokens=3)
            reply = client.request(WriteRoutingStats(), timeout_s=30.0)
            assert isinstance(reply, RoutingStatsWritten) and reply.paths[0] == str(out_path)
            on_request = read_csv(out_path)
            per_token = config.num_experts_per_tok * config.num_hidden_layers
            assert on_request.num_activations() == (7 + 2 * 2) * per_token  # 7 prompt tokens, 2 fed back each
            assert read_csv(out_path.with_name("routing.prefill.csv")).num_activations((Phase.PREFILL,)) == 7 * per_token
            _drive(client, [[8, 8, 8]], max_tokens=2)
        finally:
            client.close()
            context.term()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
    on_shutdown = read_csv(out_path)
    assert on_shutdown.num_activations() == (7 + 2 * 2 + 3 + 1) * per_token
    assert read_csv(out_path.with_name("routing.decode.csv")).num_activations((Phase.DECODE,)) == (4 + 1) * per_token
