"""FP8 storage of the KV rows (`kv_dtype = "fp8"`: main rows and CSA indexer rows), CPU and torch path: the setting
from the command line and the deployment file to the sequence states, the stores' packed rows, and the model's
outputs.

- With the reference's FP8 KV QAT on (`NumericsConfig.kv_fp8_qat`), every row is rounded to exactly the values its
  FP8 row holds, so FP8 storage changes nothing: bit-identical logits in bf16. In fp32 the rotary channels are
  stored in bf16 (the production row), so there the nope channels are exact and the logits within 1e-2.
- Without the QAT the stored rows are rounded and this forward's own rows are not: on the bundled trained model
  the logits stay within 2e-2 of fp32 storage (relative, L2 over 60 tokens of text read against stored rows;
  measured 6e-3), and the greedy tokens are the same (all but near ties, where the top two are within 0.05).
Legend: T tokens, V vocab.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from moemesh.bench.checks.tiny_model import tiny_config
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.config import NumericsConfig
from moemesh.common.model.kv_rows import IndexerRowLayout, MainRowLayout, unpack_indexer_rows, unpack_main_rows
from moemesh.common.model.kv_storage import KVStorage, parse_kv_storage
from moemesh.common.model.qat import indexer_fp8_qat, kv_nope_fp8_qat
from moemesh.common.model.random_init import random_model
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.state import SequenceState
from moemesh.common.runtime.deployment import DeploymentError, parse_deployment
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.kv_pool import BlockTable, KVPool, KVPoolError

REPO_ROOT = Path(__file__).resolve().parent.parent
MINI_MODEL = REPO_ROOT / "models" / "kjv-dsv4-mini"
RAW_DEPLOYMENT = {"model": {"path": "m"}, "attention": [{"name": "attention-0"}], "expert": [{"name": "expert-0"}]}
# one forward per entry: (sequence, new tokens) pairs, or ("rollback", sequence, tokens)
SCRIPT = (((0, 13), (1, 30)), ((0, 1), (1, 1)), ((0, 3), (1, 2)), ("rollback", 0, 2), ("rollback", 1, 1),
          ((0, 1), (1, 9)), ((0, 1), (1, 1)))


# ------------------------------------------------------------------------------------------ the setting
def _deployment(*overrides: str):
    return parse_deployment({key: (value if not isinstance(value, list) else [dict(v) for v in value])
                             for key, value in RAW_DEPLOYMENT.items()}, list(overrides))


def test_kv_dtype_defaults_to_bf16_and_a_bad_value_names_its_key():
    assert _deployment().attention[0].kv_dtype == "bf16"
    assert _deployment("attention.kv_dtype=fp8").attention[0].kv_dtype == "fp8"
    with pytest.raises(DeploymentError, match=r"attention\[0\]\.kv_dtype: 'fp4' is not one of bf16, fp8"):
        _deployment("attention.kv_dtype=fp4")
    with pytest.raises(ValueError, match="kv_dtype: 'e5m2' is not one of bf16, fp8"):
        parse_kv_storage("e5m2")
    with pytest.raises(ValueError, match="kv_storage"):
        KVPoolConfig(kv_storage="fp8")  # the pool takes the parsed storage only


def test_the_attention_worker_takes_kv_dtype_from_its_entry_or_the_command_line():
    from moemesh.services.attention.main import add_attention_arguments, attention_kv_config, options_from_args

    parser = argparse.ArgumentParser()
    add_attention_arguments(parser)
    plain, fp8_file = _deployment(), _deployment("attention.kv_dtype=fp8")
    default = options_from_args(parser.parse_args([]))
    assert attention_kv_config(plain, plain.attention[0], default).kv_storage is KVStorage.BF16
    assert attention_kv_config(fp8_file, fp8_file.attention[0], default).kv_storage is KVStorage.FP8
    given = options_from_args(parser.parse_args(["--kv-dtype", "fp8", "--kv-primary-blocks", "9"]))
    kv = attention_kv_config(plain, plain.attention[0], given)
    assert kv.kv_storage is KVStorage.FP8 and kv.num_primary_blocks == 9
    back = options_from_args(parser.parse_args(["--kv-dtype", "bf16"]))
    assert attention_kv_config(fp8_file, fp8_file.attention[0], back).kv_storage is KVStorage.BF16
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-dtype", "fp16"])


def test_serve_writes_kv_dtype_into_the_deployment(tmp_path):
    from moemesh.commands.serve_args import add_arguments
    from moemesh.commands.serve_config import ServeLayout, deployment_table, write_deployment

    parser = argparse.ArgumentParser()
    add_arguments(parser, "serve")
    assert parser.parse_args([]).kv_dtype == "bf16" and parser.parse_args(["--kv-dtype", "fp8"]).kv_dtype == "fp8"
    layout = ServeLayout(model_path=str(MINI_MODEL), run_dir=str(tmp_path), log_dir=str(tmp_path / "logs"))
    assert "kv_dtype" not in deployment_table(layout)["attention"][0]  # the default file is unchanged
    _, deployment = write_deployment(ServeLayout(**{**layout.__dict__, "kv_dtype": "fp8"}))
    assert deployment.attention[0].kv_dtype == "fp8"


def test_slots_of_an_fp8_pool_hold_fp8_rows():
    from moemesh.services.attention.slots import SlotTable

    config = tiny_config()
    layout = MainRowLayout.of(config)
    pool = KVPool(config, KVPoolConfig(block_size_tokens=16, num_primary_blocks=4, kv_storage=KVStorage.FP8),
                  torch.float32, "cpu")
    slot = SlotTable(config, pool, torch.float32, torch.device("cpu")).prepare(0, "r", 0, (0, 1), {})
    state = slot.state
    assert state.kv_storage is KVStorage.FP8 and state.main_row_layout == layout
    for layer_state in state.layers:
        assert layer_state.window.ring.dtype == torch.uint8 and layer_state.window.ring.shape[1] == layout.row_bytes
    csa = state.layers[1]
    assert csa.compressor.row_store.pool.dtype == torch.uint8 and csa.compressor.row_store.pool.shape[2] == 48
    indexer_pool = csa.indexer.row_store.pool
    assert state.indexer_row_layout == IndexerRowLayout(config.index_head_dim)
    assert indexer_pool.dtype == torch.uint8 and indexer_pool.shape[2] == config.index_head_dim + 4  # codes, scale
    assert all(ring.dtype == torch.float32 for store in (csa.compressor, csa.indexer)
               for ring in store.input_rings)  # pending inputs as they are
    assert pool.snapshot_primary[(0, "window_snapshot")].dtype == torch.uint8
    bf16_pool = KVPool(config, KVPoolConfig(block_size_tokens=16, num_primary_blocks=4), torch.float32, "cpu")
    assert pool.num_bytes_per_block() < bf16_pool.num_bytes_per_block()


# ------------------------------------------------------------------------------------------ the stores
def test_fp8_stores_pack_on_write_and_unpack_on_read():
    config = tiny_config()
    layout = MainRowLayout.of(config)
    state = SequenceState(config, kv_storage=KVStorage.FP8)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(11, config.head_dim, generator=generator)  # [S, hd] fp32
    window = state.layers[0].window
    window.append(rows)
    stored = window.read(0)
    assert stored.dtype == torch.float32 and stored.shape == rows.shape
    want = kv_nope_fp8_qat(rows, layout.nope_dim)
    want[:, layout.nope_dim:] = want[:, layout.nope_dim:].bfloat16().float()
    assert torch.equal(stored, want)  # the QAT's values, rope in bf16
    assert torch.equal(unpack_main_rows(window.ring[:11], layout), want)
    compressor = state.layers[1].compressor
    compressor.append_inputs(torch.zeros(8, compressor.input_rings[0].shape[1]),
                             torch.zeros(8, compressor.input_rings[0].shape[1]))
    compressor.write_rows(0, rows[:2])
    assert compressor.own_rows.dtype == torch.uint8 and torch.equal(compressor.read_rows(), want[:2])


def test_fp8_indexer_stores_pack_on_write_and_unpack_on_read():
    config = tiny_config()
    layout = IndexerRowLayout(config.index_head_dim)
    indexer = SequenceState(config, kv_storage=KVStorage.FP8).layers[1].indexer
    rows = torch.randn(3, config.index_head_dim, generator=torch.Generator().manual_seed(1))  # [n, d] fp32
    indexer.append_inputs(torch.zeros(12, indexer.input_rings[0].shape[1]),
                          torch.zeros(12, indexer.input_rings[0].shape[1]))
    indexer.write_rows(0, rows)
    assert indexer.own_rows.dtype == torch.uint8 and indexer.own_rows.shape[1] == layout.row_bytes
    assert torch.equal(indexer.read_rows(), indexer_fp8_qat(rows))
    assert torch.equal(unpack_indexer_rows(indexer.own_rows[:3], layout), indexer_fp8_qat(rows))
    plain = SequenceState(config).layers[1].indexer
    assert plain.own_rows.dtype == torch.float32  # bf16 storage: rows in the activation dtype, as before


def test_a_row_store_of_another_format_is_refused():
    config = tiny_config()
    bf16_pool = KVPool(config, KVPoolConfig(block_size_tokens=16, num_primary_blocks=4), torch.float32, "cpu")
    with pytest.raises(ValueError, match="layer 1 compressor: the row store holds .* FP8 main rows need"):
        SequenceState(config, kv_storage=KVStorage.FP8, row_store_factory=bf16_pool.row_store_factory(BlockTable("cpu")))
    fp8_pool = KVPool(config, KVPoolConfig(block_size_tokens=16, num_primary_blocks=4, kv_storage=KVStorage.FP8),
                      torch.float32, "cpu")
    table = BlockTable(torch.device("cpu"))
    table.update((0,))
    store = fp8_pool.row_store_factory(table)(1, "compressor", config.head_dim)
    with pytest.raises(KVPoolError, match="store rows differently"):
        store.write(0, torch.zeros(1, 48))  # float rows into the FP8 pool


# ------------------------------------------------------------------------------------------ the model
def _run(model: ReferenceModel, states: list[SequenceState], seed: int = 1) -> list[torch.Tensor]:
    """SCRIPT over `states` (prefill chunks, decode, verification, rollbacks) -> logits [T, V] per forward."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for step in SCRIPT:
        if step[0] == "rollback":
            states[step[1]].rollback(step[2])
            continue
        token_ids = torch.randint(0, model.config.vocab_size, (sum(n for _, n in step),), generator=generator)
        out.append(model.forward(token_ids, [SequenceChunk(states[i], n) for i, n in step]))
    return out


def _tiny_model(dtype: str, qat: bool) -> ReferenceModel:
    side, experts = random_model(tiny_config(), "cpu", numerics=NumericsConfig(dtype=dtype, kv_fp8_qat=qat), seed=0)
    return ReferenceModel(side, experts)


def _states(model: ReferenceModel, storage: KVStorage) -> list[SequenceState]:
    return [SequenceState(model.config, dtype=model.side.dtype, kv_storage=storage) for _ in range(2)]


def test_with_the_kv_qat_fp8_storage_is_bit_identical_in_bf16():
    model = _tiny_model("bfloat16", qat=True)
    plain, fp8 = _states(model, KVStorage.BF16), _states(model, KVStorage.FP8)
    for want, got in zip(_run(model, plain), _run(model, fp8)):
        assert torch.equal(got, want)
    for want_state, got_state in zip(plain, fp8):
        want_live, got_live = want_state.live_tensors(), got_state.live_tensors()
        assert all(torch.equal(got_live[name], tensor) for name, tensor in want_live.items())
    twins = [state.clone() for state in fp8]  # a clone continues exactly as its source
    token = torch.tensor([5, 7])
    chunks = lambda states: [SequenceChunk(state, 1) for state in states]  # noqa: E731
    assert torch.equal(model.forward(token, chunks(twins)), model.forward(token, chunks(fp8)))


def _indexer_scores_of_script(monkeypatch, qat: bool, storage: KVStorage) -> list[torch.Tensor]:
    """Every indexer score matrix [S, N] SCRIPT computes (torch path, bf16), in call order."""
    from moemesh.common.model.indexer import Indexer

    scores_of = Indexer.scores
    calls: list[torch.Tensor] = []

    def recording(self, *args):
        calls.append(scores_of(self, *args))
        return calls[-1]

    monkeypatch.setattr(Indexer, "scores", recording)
    model = _tiny_model("bfloat16", qat=qat)
    _run(model, _states(model, storage))
    monkeypatch.setattr(Indexer, "scores", scores_of)
    return calls


def test_with_the_kv_qat_fp8_indexer_rows_score_and_pick_as_the_reference_rounding(monkeypatch):
    """FP8 indexer rows (packed where written, decoded where scored) against plain rows the reference's FP8
    quant-dequant rounded at the same point (kv_fp8_qat, bf16 storage): the same indexer logits bit for bit and so
    the same top-k picks, in every forward of SCRIPT (prefill chunks, decode, verification, rollbacks). Without the
    rounding the logits differ (the comparison can fail)."""
    want = _indexer_scores_of_script(monkeypatch, True, KVStorage.BF16)
    got = _indexer_scores_of_script(monkeypatch, True, KVStorage.FP8)
    unrounded = _indexer_scores_of_script(monkeypatch, False, KVStorage.BF16)
    assert len(got) == len(want) == len(unrounded) and sum(s.shape[1] > 2 for s in want) > 4  # the top-2 picks
    for want_scores, got_scores in zip(want, got):
        assert torch.equal(got_scores, want_scores)
        if want_scores.shape[1] > 2:
            assert torch.equal(got_scores.topk(2, dim=-1).indices, want_scores.topk(2, dim=-1).indices)
    assert any(not torch.equal(a, b) for a, b in zip(unrounded, want) if a.numel())


def test_with_the_kv_qat_in_fp32_only_the_rotary_channels_round():
    model = _tiny_model("float32", qat=True)
    plain, fp8 = _states(model, KVStorage.BF16), _states(model, KVStorage.FP8)
    for want, got in zip(_run(model, plain), _run(model, fp8)):
        assert float((got - want).norm() / want.norm()) < 1e-2
    nope = model.config.nope_head_dim
    for want_state, got_state in zip(plain, fp8):
        got = got_state.layers[0].window.read(max(0, got_state.num_tokens - 8))
        want = want_state.layers[0].window.read(max(0, want_state.num_tokens - 8))
        assert torch.equal(got[:, :nope], want[:, :nope])  # the QAT's own values, exactly
        assert torch.equal(got[:, nope:], want[:, nope:].bfloat16().float())


@pytest.fixture(scope="module")
def mini_model():
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.checkpoint.reference_model import load_reference_model

    return load_reference_model(CheckpointReader(str(MINI_MODEL)), NumericsConfig())


GENESIS = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
           "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
           "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided the "
           "light from the darkness. And God called the light Day, and the darkness he called Night. And the evening "
           "and the morning were the first day. And God said, Let there be a firmament in the midst of the waters, and "
           "let it divide the waters from the waters. And God made the firmament, and divided the waters which were "
           "under the firmament from the waters which were above the firmament: and it was so.")


def test_without_the_qat_fp8_storage_stays_close_on_the_trained_model(mini_model):
    """160 tokens of text (past the 128-token window: 40 CSA rows, one HCA row) as a 100-token chunk, a chunk that
    reads the first one's rows from storage, and 2 decode steps; the logits of every token after the first chunk."""
    from tokenizers import Tokenizer

    token_ids = torch.tensor(Tokenizer.from_file(str(MINI_MODEL / "tokenizer.json")).encode(GENESIS).ids)
    num_tokens = token_ids.shape[0]
    chunks = ((0, 100), (100, num_tokens - 2), (num_tokens - 2, num_tokens - 1), (num_tokens - 1, num_tokens))
    outputs = {}
    for storage in KVStorage:
        state = SequenceState(mini_model.config, kv_storage=storage)
        logits = [mini_model.forward(token_ids[start:end], [SequenceChunk(state, end - start)])
                  for start, end in chunks]
        outputs[storage] = torch.cat(logits[1:])  # [T, V]
    want, got = outputs[KVStorage.BF16], outputs[KVStorage.FP8]
    assert not torch.equal(got, want)  # the rows did round
    assert float((got - want).norm() / want.norm()) < 2e-2
    top2 = want.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > 0.05  # not a near tie
    assert int(decided.sum()) > 0.9 * want.shape[0]
    assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])


# ------------------------------------------------------------------------------------------ the worker
def test_an_fp8_attention_worker_generates_what_the_reference_does_with_fp8_rows(tmp_path, caplog):
    """The worker (every routed expert its own, no expert process) with kv_storage FP8: paged FP8 rows, the QAT
    on, and the greedy tokens of the reference model on FP8 states with the QAT (prefill chunks, decode)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention_worker_support import attention_worker, run_offline, tiny_fp4_checkpoint

    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.model.attention_side import AttentionSide
    from moemesh.common.model.moe import RoutedExperts
    from moemesh.common.placement.worker_holdings import all_pairs
    from moemesh.common.sampling_params import SamplingParams

    path, config = tiny_fp4_checkpoint(tmp_path / "ckpt", seed=21)
    pairs = tuple(all_pairs(config.num_hidden_layers, config.n_routed_experts))
    kv = KVPoolConfig(block_size_tokens=128, num_primary_blocks=4, kv_storage=KVStorage.FP8)
    with capture_logs() as logs:
        worker = attention_worker(path, None, None, pairs, kv=kv)
    capacity = [event for event in logs if event["event"] == "attention.kv_capacity"]
    assert len(capacity) == 1 and capacity[0]["message"] == "KV capacity: 512 tokens on cpu, 0 on the CPU tier"
    assert capacity[0]["device_bytes"] == (4 * worker.pool.num_bytes_per_block()  # what the pool allocated
                                           + kv.num_primary_snapshots * worker.pool.num_bytes_per_snapshot())
    assert capacity[0]["by_layer_type"]["indexer"]["row_bytes_per_block"] == sum(
        tensor[0].numel() * tensor.element_size() for (_, name), tensor in worker.pool.primary.items()
        if name.startswith("indexer"))
    assert worker.side.layers[0].attn.fp8_qat_nope_dim == config.nope_head_dim  # the QAT comes with FP8 rows
    csa = next(layer for layer in worker.side.layers if layer.attn.indexer is not None)
    assert csa.attn.indexer.compressor.fp8_qat_nope_dim == config.index_head_dim  # and rounds the indexer rows
    assert worker.pool.snapshot_primary[(0, "window_snapshot")].dtype == torch.uint8
    prompts = [[5, 9, 17], list(range(30, 52))]
    got, _ = run_offline(worker, prompts, SamplingParams(max_tokens=5))

    reader = CheckpointReader(str(path), config=config)
    numerics = NumericsConfig(kv_fp8_qat=True)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config), numerics)
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, list(pairs)), config))
    for prompt, tokens in zip(prompts, got):
        state = SequenceState(config, kv_storage=KVStorage.FP8)
        logits = model.forward(torch.tensor(prompt), [SequenceChunk(state, len(prompt))])
        want = []
        for _ in range(5):
            want.append(int(logits[-1].argmax()))
            logits = model.forward(torch.tensor(want[-1:]), [SequenceChunk(state, 1)])
        assert tokens == want
