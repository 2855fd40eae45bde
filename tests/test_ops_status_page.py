"""The status page at `/` rendered by headless Chromium (Debian's `chromium`) from a real
`moemesh serve` on the default model, after real requests.

The page is static HTML that fetches `/status.json` and renders it with its own script, so the
test reads what the browser built (`--dump-dom` after `--virtual-time-budget` let the fetch and
the render run): overall health, each service ok with its pid, the placement rows, KV use, the
requests served, and the layer x expert heat map with the live routing counts. The screenshot
(`--screenshot`, saved in the test's tmp dir) must be a real render: the window's size, many
colours, the heat map's red cells and the green "ok"s; with MOEMESH_STATUS_SCREENSHOT=1 a copy
goes to bench/results/status-page-<UTC time>.png. The same server's log and terminal show each
worker's loading progress. Skips without chromium.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import struct
import subprocess
import threading
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from moemesh.bench.soak import child_pids
from spec_support import DEFAULT_MODEL, start_serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REPO_ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT_ENV = "MOEMESH_STATUS_SCREENSHOT"  # "1" or a directory: keep a copy of the screenshot
MODEL = "kjv-dsv4-mini"
NUM_LAYERS, NUM_EXPERTS = 6, 8  # the default model's config.json
WINDOW = (1000, 1300)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package chromium)"),
    pytest.mark.skipif(not any(DEFAULT_MODEL.glob("*.safetensors")), reason="default model weights missing"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # experts in expert-0, the drafter in a draft worker process: every kind of service has its row
    server = start_serve(tmp_path_factory.mktemp("status"), "--experts-in-attention", "none",
                         "--draft-placement", "process")
    if "moemesh serving" not in server.first_line:
        server.stop()
        pytest.fail(f"serve did not start: {server.first_line!r}\n{server.logs()}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(server) -> dict:
    """Requests until the attention worker's routing summary (every 32 steps) reached the router;
    returns the /status.json seen then."""
    num_requests, deadline = 0, time.monotonic() + 300
    while time.monotonic() < deadline:
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "In the beginning God", "max_tokens": 32, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        num_requests += 1
        status = httpx.get(f"{server.base_url}/status.json", timeout=10).json()
        if status["layer_heat"]:
            speculating = "speculation off" not in server.first_line  # serve names "fixed, width N" etc.
            print(f"status after {num_requests} requests: throughput={status['throughput']} "
                  f"engine={status['engine']} ({server.first_line.strip()})")
            return {"status": status, "num_requests": num_requests, "speculating": speculating}
    pytest.fail(f"no routing counts on /status.json after {num_requests} requests")


def _chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", f"--user-data-dir={cwd / 'profile'}", "--virtual-time-budget=5000", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


class _Page(HTMLParser):
    """Text per element id (all nested text), and the attributes of every heat-map cell."""

    def __init__(self) -> None:
        super().__init__()
        self.text_by_id: dict[str, str] = {}
        self.rows_by_id: dict[str, list[list[str]]] = {}
        self.cells: list[dict[str, str]] = []
        self._open: list[tuple[str, str | None]] = []  # (tag, id)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("br", "meta", "img"):
            return
        self._open.append((tag, attrs.get("id")))
        if attrs.get("id"):
            self.text_by_id.setdefault(attrs["id"], "")
            self.rows_by_id.setdefault(attrs["id"], [])
        if tag == "td" and attrs.get("class") == "cell":
            self.cells.append(attrs)
        if tag == "tr":
            for _, element_id in self._open:
                if element_id:
                    self.rows_by_id[element_id].append([])
        if tag in ("td", "th"):
            for _, element_id in self._open:
                if element_id and self.rows_by_id[element_id]:
                    self.rows_by_id[element_id][-1].append("")

    def handle_endtag(self, tag):
        for index in range(len(self._open) - 1, -1, -1):
            if self._open[index][0] == tag:
                del self._open[index:]
                break

    def handle_data(self, data):
        for _, element_id in self._open:
            if element_id:
                self.text_by_id[element_id] += data
                rows = self.rows_by_id[element_id]
                if rows and rows[-1]:
                    rows[-1][-1] += data


def _decode_png(data: bytes) -> tuple[int, int, list[bytearray]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, compressed = 8, b""
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour_type in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            compressed += body
    bpp = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(compressed), width * bpp
    rows, previous = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, row = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = row[i - bpp] if i >= bpp else 0
            up = previous[i]
            if kind == 1:
                row[i] = (row[i] + left) & 0xFF
            elif kind == 2:
                row[i] = (row[i] + up) & 0xFF
            elif kind == 3:
                row[i] = (row[i] + ((left + up) >> 1)) & 0xFF
            elif kind == 4:
                upper_left = previous[i - bpp] if i >= bpp else 0
                estimate = left + up - upper_left
                pa, pb, pc = abs(estimate - left), abs(estimate - up), abs(estimate - upper_left)
                row[i] = (row[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else upper_left)) & 0xFF
        rows.append(row)
        previous = row
    return width, height, [bytearray(r[i] for i in range(len(r)) if i % bpp < 3) for r in rows]


def test_status_page_shows_the_live_data_in_chromium(server, served, tmp_path):
    status = served["status"]
    result = _chromium("--dump-dom", f"{server.base_url}/", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    page = _Page()
    page.feed(result.stdout)

    assert page.text_by_id["overall"].strip() == "healthy"
    assert page.text_by_id["updated"].startswith("updated ")  # the script ran and rendered a snapshot
    services = {row[0]: row for row in page.rows_by_id["services"][1:]}
    pids = {row["name"]: row["pid"] for row in status["services"]}
    for name in ("attention-0", "expert-0", "draft"):
        assert services[name][1] == "ok" and services[name][4] == str(pids[name]), services
    router_pid = child_pids(server.process.pid)["router"]  # the gateway itself heads the table
    assert services["router"][1] == "ok" and services["router"][4] == str(router_pid), services
    assert page.rows_by_id["services"][1][0] == "router" and services["router"][5].startswith("up ")
    # which experts on which device: one row per worker, its device, the expert ids per layer
    device = next(row["device"] for row in status["services"] if row["name"] == "expert-0")
    assert device and page.rows_by_id["placement"] == [
        ["worker", "device", *(f"L{layer}" for layer in range(NUM_LAYERS))],
        ["expert-0", device, *(f"0–{NUM_EXPERTS - 1}" for _ in range(NUM_LAYERS))]]
    engine_text = page.text_by_id["engine"]
    assert "KV gpu:" in engine_text and "/ 256" in engine_text and "KV cpu:" in engine_text
    num_served = int(page.text_by_id["served"].split()[1])
    assert num_served >= served["num_requests"]
    throughput_text = page.text_by_id["throughput"]
    assert "tokens/s" in throughput_text and "generated" in throughput_text
    if served["speculating"]:  # the drafter ran: its acceptance is a percentage, not a dash
        acceptance = status["throughput"]["spec_acceptance"]
        assert acceptance is not None and 0.0 <= acceptance <= 1.0, status["throughput"]
        assert throughput_text.rstrip().endswith("%"), throughput_text
    progress = {row[0]: row for row in page.rows_by_id["progress"][1:]}
    assert {"attention-0", "expert-0"} <= set(progress), progress
    records = {record["name"]: record for record in status["load_progress"]}
    print(f"load progress: {records}")
    for name in ("attention-0", "expert-0"):  # bytes (of the share it was expected to read), tensors, done
        loaded = progress[name][1].split()  # "<MiB read> of <MiB expected> MiB"
        assert float(loaded[0]) > 0 and loaded[1] == "of" and int(progress[name][2]) > 0 and progress[name][3] == "yes"
        record = records[name]
        # the share sized from config + placement is exactly what the worker's reader counted
        assert record["fraction"] == 1.0 and record["num_bytes"] == record["num_bytes_expected"], record

    # the heat map: one cell per (layer, expert), carrying the live counts (they only grow)
    assert len(page.cells) == NUM_LAYERS * NUM_EXPERTS
    counts = [int(cell["data-count"]) for cell in page.cells]
    seen_before = [count for layer in status["layer_heat"] for count in layer]
    assert all(now >= before for now, before in zip(counts, seen_before)) and sum(counts) > 0
    assert len(set(cell["style"] for cell in page.cells)) > 1  # coloured by share, not uniformly
    assert f"{NUM_LAYERS} layers × {NUM_EXPERTS} experts" in page.text_by_id["heatnote"]


class _Load:
    """`num_requests` concurrent greedy streams in threads, so the page shows work in flight; `stop()`
    drops them (the gateway aborts them) and returns how many chunks each had received."""

    def __init__(self, server, num_requests: int, max_tokens: int) -> None:
        self.stopping = threading.Event()
        self.num_chunks: list[int] = []
        body = {"model": MODEL, "prompt": "In the beginning God", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}

        def one() -> None:
            num_chunks = 0
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as reply:
                for line in reply.iter_lines():
                    num_chunks += line.startswith("data: ")
                    if self.stopping.is_set():
                        break
            self.num_chunks.append(num_chunks)

        self.threads = [threading.Thread(target=one, daemon=True) for _ in range(num_requests)]
        for thread in self.threads:
            thread.start()

    def stop(self) -> list[int]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)
        return self.num_chunks


def test_status_page_screenshot_is_a_real_render(server, served, tmp_path):
    """Taken while requests run, so running / KV use are live figures (and the committed
    screenshot shows them); the DOM rendered at that moment says so too. The streams are then
    dropped: the aborted requests leave nothing running and no KV block held."""
    load = _Load(server, num_requests=4, max_tokens=600)
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.base_url}/status.json", timeout=10).json()["engine"]["num_running"] < 1:
        assert time.monotonic() < deadline, "the requests never showed as running"
        time.sleep(0.1)
    dom = _chromium("--dump-dom", f"{server.base_url}/", cwd=tmp_path)
    shot = tmp_path / "status.png"
    result = _chromium(f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}", f"{server.base_url}/",
                       cwd=tmp_path)
    assert len(load.stop()) == 4
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    page = _Page()
    page.feed(dom.stdout)
    engine_text = " ".join(page.text_by_id["engine"].split())
    num_running = int(engine_text.split("running ", 1)[1].split(",", 1)[0])
    gpu_used = int(engine_text.split("KV gpu: ", 1)[1].split(" / ", 1)[0])
    assert num_running >= 1 and gpu_used >= 1, engine_text  # rendered while they ran: live, non-zero
    engine: dict = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine = httpx.get(f"{server.base_url}/status.json", timeout=10).json()["engine"]
        if engine["num_running"] == 0 and engine["num_waiting"] == 0 and engine["kv_blocks_used"]["gpu"] == 0:
            break
        time.sleep(0.2)
    assert engine["num_running"] == engine["num_waiting"] == 0 and engine["kv_blocks_used"] == {"gpu": 0, "cpu": 0}
    width, height, rows = _decode_png(shot.read_bytes())
    assert (width, height) == WINDOW
    pixels = [tuple(row[i:i + 3]) for row in rows[::4] for i in range(0, len(row), 12)]  # a 4 x 4 grid sample
    assert len(set(pixels)) > 20, "a near single-colour image"
    reddish = sum(1 for r, g, b in pixels if r > g + 40 and r > b + 40)  # heat-map cells
    greenish = sum(1 for r, g, b in pixels if g > r + 40 and g > b + 20)  # "healthy" / "ok"
    assert reddish > 100 and greenish > 3, (reddish, greenish)
    saved = _keep_screenshot(shot)
    print(f"status page screenshot: {saved or shot}")


def _keep_screenshot(shot: Path) -> Path | None:
    """With MOEMESH_STATUS_SCREENSHOT set ("1": bench/results/, else a directory), a copy named
    `status-page-<UTC time>.png` to commit beside the benchmark results."""
    target = os.environ.get(SCREENSHOT_ENV)
    if not target:
        return None
    out_dir = REPO_ROOT / "bench" / "results" if target == "1" else Path(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = out_dir / f"status-page-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}.png"
    shutil.copyfile(shot, saved)
    return saved


def test_serve_showed_load_progress_in_its_log_and_on_the_terminal(server, served):
    """Each worker logged `<role>.load_progress` with bytes and tensors (the last one done),
    and `moemesh serve` drew its progress line (a bar per worker) on stderr until ready."""
    for name, role in (("attention-0", "attention"), ("expert-0", "expert")):
        events = [json.loads(line) for line in (server.run_dir / "logs" / f"{name}.log").read_text().splitlines()
                  if line.startswith("{")]
        progress = [e for e in events if e["event"] == f"{role}.load_progress" and e.get("name") == name]
        assert progress and progress[-1]["done"] is True, progress
        assert progress[-1]["num_bytes"] > 0 and progress[-1]["num_tensors"] > 0, progress[-1]
    terminal = (server.run_dir / "serve.stderr").read_text(errors="replace")
    lines = [line for line in terminal.splitlines() if line.startswith("waiting for services")]  # \r-separated
    assert lines, terminal[-2000:]
    assert all("attention-0 [" in line and "expert-0 [" in line for line in lines), lines[-1]
