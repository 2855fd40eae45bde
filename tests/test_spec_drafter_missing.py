"""A checkpoint that announces a drafter (dspark_* keys) but lacks its weights ("nothing silent").

`moemesh serve` on a copy of the default model without its `mtp.*` tensors, with the drafter in the
attention worker (serve's default) and in a draft worker process: the drafter fails while loading,
serve says so on its ready line (and, for the process, on stderr), keeps serving, /health stays 200
with the drafter's entry not "ok", and every response says speculation did not run, with the
greedy text of the full model (the target's weights are all there).
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from spec_support import DEFAULT_MODEL, start_serve

pytestmark = [
    pytest.mark.slow,  # one serve per placement (~20 s each on an idle 2-core host)
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors.index.json").exists(), reason="default model missing"),
]


def _without_drafter(target):
    target.mkdir()
    for path in DEFAULT_MODEL.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copyfile(path, target / path.name)
    index = json.loads((DEFAULT_MODEL / "model.safetensors.index.json").read_text())
    kept = {name: shard for name, shard in index["weight_map"].items() if not name.startswith("mtp.")}
    assert len(kept) < len(index["weight_map"])
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {name: tensor for name, tensor in load_file(DEFAULT_MODEL / shard).items() if name in kept}
        save_file(tensors, target / shard, metadata={"format": "pt"})
    (target / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": kept}))
    config = json.loads((target / "config.json").read_text())
    assert config.get("dspark_block_size")  # the drafter is announced, so serve defaults to adaptive
    return target


@pytest.mark.parametrize("placement", ["attention", "process"])
def test_serving_goes_on_without_a_drafter_that_fails_to_load_and_says_so(tmp_path, placement):
    model = _without_drafter(tmp_path / "kjv-dsv4-mini")  # the served model name is the directory name
    server = start_serve(tmp_path / "run", "--draft-placement", placement, model=model)
    try:
        assert "moemesh serving" in server.first_line, server.logs()
        if placement == "process":
            assert "speculation off: the draft worker failed" in server.first_line, server.first_line
            assert "the draft worker exited" in (tmp_path / "run" / "serve.stderr").read_text()
        else:
            assert "speculation off: the drafter failed to load" in server.first_line, server.first_line
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 200
        draft_status = health.json()["services"]["draft"]
        assert draft_status != "ok" and "without speculation" in draft_status, draft_status
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
            "model": "kjv-dsv4-mini", "prompt": "In the beginning God", "max_tokens": 12, "temperature": 0})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["completion_tokens"] > 0
        assert usage["speculative"] == {"ran": False, "draft_tokens": 0, "accepted_tokens": 0,
                                        "mean_accepted_length": 0.0}
    finally:
        assert server.stop() == 0
