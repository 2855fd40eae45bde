"""Packed token streams: units, loss masks, windows, and the build_dataset command."""

import json

import numpy as np
import pytest

from moemesh.common.chat import tokens as tk
from moemesh.tools.corpus.chat_examples import ChatExampleConfig, build_chat_examples
from moemesh.tools.corpus.dataset import (
    DatasetConfig,
    build_stream,
    chat_units,
    pack,
    running_text_units,
    tokenize_units,
)
from moemesh.tools.corpus.kjv import Verse, bible_program_available
from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID, PAD_ID
from moemesh.tools.corpus.tokenizer import load_tokenizer

VERSES = [Verse("Genesis", 1, n, f"Verse number {n} of the first chapter, and God saw it.") for n in range(1, 31)] + [
    Verse("John", 3, 16, "For God so loved the world, that he gave his only begotten Son."),
    Verse("John", 3, 17, "For God sent not his Son into the world to condemn the world."),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_running_text_units_cover_every_verse_once_in_bounded_chunks():
    config = DatasetConfig(max_verses_per_chunk=4)
    units = running_text_units(VERSES, config)
    assert all(u.text.startswith(tk.BOS) and u.text.endswith(tk.EOS) and u.target_start == 0 for u in units)
    lines = [line for u in units for line in u.text.removeprefix(tk.BOS).removesuffix(tk.EOS).splitlines()]
    assert lines == [f"{v.reference} {v.text}" for v in VERSES]
    assert all(1 <= u.text.count("\n") <= 4 for u in units)
    assert len(units) >= 1 + 30 // 4  # chapters are chunked, not kept whole
    assert units == running_text_units(VERSES, config)


def test_chat_loss_mask_covers_exactly_the_answer(tokenizer):
    examples = build_chat_examples(VERSES[-1:], ChatExampleConfig(continuation_examples_per_verse=0))
    [(ids, mask)] = tokenize_units(tokenizer, chat_units(examples))
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    targets = [int(i) for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(targets, skip_special_tokens=False) == VERSES[-1].text + tk.EOS
    assert mask[0] == 0 and mask[-1] == 1
    assert (np.diff(mask.astype(int)) >= 0).all()  # prompt zeros, then answer ones


def test_pack_pads_the_last_window_and_keeps_order():
    pieces = [(np.arange(1, 6, dtype=np.uint16), np.ones(5, np.uint8)), (np.arange(6, 9, dtype=np.uint16), np.zeros(3, np.uint8))]
    ids, mask, num_tokens = pack(pieces, seq_len=3)
    assert num_tokens == 8 and ids.shape == (3, 3) and ids.dtype == np.uint16
    assert ids.ravel().tolist() == [1, 2, 3, 4, 5, 6, 7, 8, PAD_ID]
    assert mask.ravel().tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        pack(pieces, seq_len=1)


def test_build_stream_shuffles_deterministically_and_loses_nothing(tokenizer):
    examples = build_chat_examples(VERSES, ChatExampleConfig())
    config = DatasetConfig(seq_len=64, max_verses_per_chunk=3)
    first = build_stream(tokenizer, VERSES, examples, config, shuffle=True)
    again = build_stream(tokenizer, VERSES, examples, config, shuffle=True)
    ordered = build_stream(tokenizer, VERSES, examples, config, shuffle=False)
    other_seed = build_stream(tokenizer, VERSES, examples, DatasetConfig(seq_len=64, max_verses_per_chunk=3, seed=5), shuffle=True)
    assert np.array_equal(first.token_ids, again.token_ids) and np.array_equal(first.loss_mask, again.loss_mask)
    assert not np.array_equal(first.token_ids, ordered.token_ids)
    assert not np.array_equal(first.token_ids, other_seed.token_ids)
    assert first.num_tokens == ordered.num_tokens == first.num_running_tokens + first.num_chat_tokens
    flat = first.token_ids.ravel()[: first.num_tokens]
    assert int((flat == BOS_ID).sum()) == len(running_text_units(VERSES, config)) + len(examples)
    assert sorted(flat.tolist()) == sorted(ordered.token_ids.ravel()[: ordered.num_tokens].tolist())
    assert (first.token_ids.ravel()[first.num_tokens :] == PAD_ID).all()
    text = tokenizer.decode(ordered.token_ids.ravel()[: ordered.num_tokens].tolist(), skip_special_tokens=False)
    assert text.startswith(tk.BOS + "Genesis 1:1 Verse number 1 of the first chapter")


@pytest.mark.skipif(not bible_program_available(), reason="`bible` (apt-get install bible-kjv) absent")
def test_build_dataset_command_writes_arrays_and_manifest(tmp_path):
    from moemesh.tools.corpus.build_dataset import main

    assert main(["--out", str(tmp_path), "--seq-len", "512"]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["seq_len"] == 512 and manifest["vocab_size"] == 12288
    assert manifest["figures"]["num_verses"] == 31102 and len(manifest["validation_chapters"]) == 30
    for name in ("train", "validation"):
        info = manifest["streams"][name]
        ids = np.load(tmp_path / info["ids_file"], allow_pickle=False)
        mask = np.load(tmp_path / info["loss_mask_file"], allow_pickle=False)
        assert ids.dtype == np.uint16 and mask.dtype == np.uint8
        assert ids.shape == mask.shape == (info["num_windows"], 512)
        assert int(mask.sum()) == info["num_target_tokens"] < info["num_tokens"] <= ids.size
    assert manifest["streams"]["train"]["num_tokens"] > 30 * manifest["streams"]["validation"]["num_tokens"]
