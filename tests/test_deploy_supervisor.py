"""deploy/supervisor/moemesh.conf: one program per service, per-service logs, autorestart."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

CONF = Path(__file__).resolve().parents[1] / "deploy" / "supervisor" / "moemesh.conf"
SERVICES = {"router": None, "attention": "--name attention-%(process_num)d",
            "expert": "--name expert-%(process_num)d", "draft": None}


@pytest.fixture(scope="module")
def conf() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser()  # supervisor expands %(...)s itself
    assert parser.read(CONF) == [str(CONF)]
    return parser


def test_one_program_per_service(conf):
    programs = {section.removeprefix("program:") for section in conf.sections() if section.startswith("program:")}
    assert programs == {f"moemesh-{service}" for service in SERVICES} | {"moemesh-mps"}
    assert set(conf["group:moemesh"]["programs"].split(",")) == programs
    for service, selector in SERVICES.items():
        program = conf[f"program:moemesh-{service}"]
        command = f"/opt/moemesh/.venv/bin/moemesh {service} --config /etc/moemesh/moemesh.toml"
        assert program["command"] == command + (f" {selector}" if selector else ""), service
        if selector:  # several workers: one process each, with distinct names
            assert "%(process_num)d" in program["process_name"], service


def test_per_service_logs_and_autorestart(conf):
    log_paths = []
    for section in conf.sections():
        if not section.startswith("program:"):
            continue
        program = conf[section]
        assert program["autorestart"] in ("true", "unexpected"), section
        if program["autorestart"] == "unexpected":
            assert program.get("exitcodes", "0") == "0", section  # a drained service (exit 0) stays down
        for key in ("stdout_logfile", "stderr_logfile"):
            if key in program:
                path = program[key].replace("%(program_name)s", section.removeprefix("program:"))
                assert path.startswith("/var/log/moemesh/"), section
                assert section.removeprefix("program:").removeprefix("moemesh-") in path, section
                if "process_num" in program.get("process_name", ""):
                    assert "%(process_num)d" in path, section  # one file per worker process
                log_paths.append(path)
        assert program.get("redirect_stderr") == "true" or "stderr_logfile" in program, section
    assert len(log_paths) == len(set(log_paths))  # no two programs share a log file


def test_stop_gives_the_drain_time_to_finish(conf):
    for service in SERVICES:
        program = conf[f"program:moemesh-{service}"]
        assert program["stopsignal"] == "TERM"
        assert int(program["stopwaitsecs"]) > 30  # longer than the default drain bound (timeouts.drain_s)
        assert program["killasgroup"] == "true"


def test_supervisord_itself_accepts_the_file(tmp_path):
    """With the `supervisor` package installed (not a moemesh dependency), its own parser must
    accept the file; user and log directory are pointed at ones that exist here."""
    options_module = pytest.importorskip("supervisor.options")
    import getpass

    program_conf = tmp_path / "moemesh.conf"
    program_conf.write_text(CONF.read_text().replace("/var/log/moemesh/", f"{tmp_path}/")
                            .replace("user=moemesh", f"user={getpass.getuser()}"))
    main_conf = tmp_path / "supervisord.conf"
    main_conf.write_text(f"[supervisord]\nlogfile={tmp_path}/supervisord.log\npidfile={tmp_path}/supervisord.pid\n"
                         f"[include]\nfiles = {program_conf}\n")
    options = options_module.ServerOptions()
    options.realize(args=["-c", str(main_conf)])
    names = {process.name for group in options.process_group_configs for process in group.process_configs}
    assert {"moemesh-router", "moemesh-attention-0", "moemesh-expert-0", "moemesh-expert-1", "moemesh-draft"} <= names
