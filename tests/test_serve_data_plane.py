"""The data-plane key of `moemesh serve`'s layout and of deployment files: zmq everywhere, cuda_ipc only
when the attention worker and every expert worker run on CUDA devices of one host, mailbox only with a
CPU expert worker on the attention worker's host (refused clearly otherwise, before anything is written
or started)."""

from __future__ import annotations

import pytest

from moemesh.commands.serve_config import ServeLayout, write_deployment
from moemesh.common.runtime.data_plane import (
    DataPlaneRefused, WorkerPlace, check_data_plane, check_deployment_data_plane,
)
from moemesh.common.runtime.deployment import DeploymentError, parse_deployment
from moemesh.common.wire.cuda_ipc import DataPlane


def deployment_keys(path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text(encoding="utf-8"))["attention"][0]


def _layout(tmp_path, devices, data_plane, num_expert_workers=2) -> ServeLayout:
    return ServeLayout(model_path="/models/x", run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"),
                       num_expert_workers=num_expert_workers, devices=devices, data_plane=data_plane)


def test_zmq_is_the_default_and_runs_anywhere(tmp_path):
    layout = ServeLayout(model_path="/models/x", run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"))
    assert layout.data_plane == "zmq"
    path, deployment = write_deployment(layout)
    assert (deployment.attention[0].data_plane, deployment.attention[0].cuda_graphs) == ("zmq", False)
    assert deployment_keys(path) == {"name": "attention-0", "device": "cpu"}  # what a deploy unit reads


def test_cuda_ipc_on_gpus_of_this_host(tmp_path):
    layout = _layout(tmp_path, ("cuda:0", "cuda:1"), "cuda_ipc", num_expert_workers=3)
    path, deployment = write_deployment(layout)
    assert path.is_file() and [w.device for w in deployment.expert] == ["cuda:0", "cuda:1", "cuda:0"]
    assert deployment.attention[0].data_plane == "cuda_ipc"  # the attention worker reads it from the file
    assert deployment_keys(path)["data_plane"] == "cuda_ipc"


def test_cuda_graphs_travel_in_the_deployment_file(tmp_path):
    layout = ServeLayout(model_path="/models/x", run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"),
                         devices=("cuda:0",), cuda_graphs=True)
    path, deployment = write_deployment(layout)
    assert deployment.attention[0].cuda_graphs is True and deployment_keys(path)["cuda_graphs"] is True


def test_attention_cli_overrides_the_file_only_when_given():
    import argparse

    from moemesh.services.attention.main import add_attention_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_attention_arguments(parser)
    default = options_from_args(parser.parse_args([]))
    assert (default.data_plane, default.cuda_graphs) == (None, None)  # None: the deployment's keys
    given = options_from_args(parser.parse_args(["--data-plane", "zmq", "--cuda-graphs", "on"]))
    assert (given.data_plane, given.cuda_graphs) == ("zmq", True)


@pytest.mark.parametrize("devices, culprit", [(("cpu",), "attention-0 is on 'cpu'"),
                                               (("cuda:0", "cpu"), "expert-1 is on 'cpu'")])
def test_cuda_ipc_refused_off_the_gpu_before_writing(tmp_path, devices, culprit):
    with pytest.raises(DataPlaneRefused, match=culprit) as refused:
        write_deployment(_layout(tmp_path, devices, "cuda_ipc"))
    assert isinstance(refused.value, DeploymentError)  # serve reports it as a bad deployment, exit 2
    assert not (tmp_path / "deployment.toml").exists()


def test_mailbox_needs_a_cpu_expert_worker_of_this_host_or_one_on_its_gpu(tmp_path):
    path, deployment = write_deployment(_layout(tmp_path, ("cuda:0", "cpu"), "mailbox"))
    assert deployment.attention[0].data_plane == "mailbox" and deployment_keys(path)["data_plane"] == "mailbox"
    (tmp_path / "gpus").mkdir()
    _, on_gpus = write_deployment(_layout(tmp_path / "gpus", ("cuda:0", "cuda:1"), "mailbox"))
    assert [w.device for w in on_gpus.expert] == ["cuda:0", "cuda:1"]  # expert-0 shares the attention GPU
    attention = WorkerPlace("attention-0", "cuda:0")
    with pytest.raises(DataPlaneRefused, match="mailbox needs an expert worker on the CPU .* or on its GPU"):
        check_data_plane("mailbox", attention, [WorkerPlace("expert-0", "cuda:1"), WorkerPlace("expert-1", "cuda:2")])
    assert check_data_plane("mailbox", attention, [WorkerPlace("expert-0", "cuda:1"),
                                                   WorkerPlace("expert-1", "cuda:0")]) == "mailbox"
    remote_cpu = WorkerPlace("expert-0", "cpu", host="10.0.0.2")
    with pytest.raises(DataPlaneRefused, match="mailbox"):
        check_data_plane("mailbox", WorkerPlace("attention-0", "cuda:0", host="10.0.0.1"), [remote_cpu])


def test_unknown_data_plane_refused(tmp_path):
    with pytest.raises(DataPlaneRefused, match="'rdma' is not one of zmq, cuda_ipc, mailbox"):
        write_deployment(_layout(tmp_path, ("cuda:0",), "rdma"))


def _deployment(expert_host: str | None, expert_device: str = "cuda:1"):
    expert = {"name": "expert-0", "device": expert_device, **({"host": expert_host} if expert_host else {})}
    return parse_deployment({"model": {"path": "/models/x"}, "router": {"host": "10.0.0.1"},
                             "attention": [{"name": "attention-0", "device": "cuda:0", "host": "10.0.0.1"}],
                             "expert": [{"name": "expert-near", "device": "cuda:0", "host": "10.0.0.1"}, expert]})


def test_deployment_file_same_host_accepted():
    assert check_deployment_data_plane(_deployment("10.0.0.1"), "cuda_ipc") is DataPlane.CUDA_IPC
    assert check_deployment_data_plane(_deployment(None), "cuda_ipc") is DataPlane.CUDA_IPC  # the router's host
    assert check_deployment_data_plane(_deployment("10.0.0.2"), "zmq") is DataPlane.ZMQ


def test_deployment_file_other_host_refused():
    with pytest.raises(DataPlaneRefused, match="expert-0 is on host 10.0.0.2, attention-0 on 10.0.0.1"):
        check_deployment_data_plane(_deployment("10.0.0.2"), "cuda_ipc")
    with pytest.raises(DataPlaneRefused, match="expert-0 is on 'cpu'"):
        check_deployment_data_plane(_deployment("10.0.0.1", "cpu"), "cuda_ipc")


def test_host_none_means_the_routers_host():
    place = WorkerPlace("attention-0", "cuda:0")
    assert check_data_plane("cuda_ipc", place, [WorkerPlace("expert-0", "cuda:0")]) is DataPlane.CUDA_IPC
    with pytest.raises(DataPlaneRefused, match="host 10.0.0.9"):
        check_data_plane("cuda_ipc", place, [WorkerPlace("expert-0", "cuda:0", "10.0.0.9")])
