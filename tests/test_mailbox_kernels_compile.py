"""The mailbox's GPU kernels (the attention worker's post / wait / combine / doorbell, a GPU expert worker's
take / release) compile for Hopper on any machine: Triton lowers them to PTX without a GPU. Their inline
PTX (acquire loads, release stores, system fences, %globaltimer) cannot run under the interpreter, so this
is what CI checks of them; tests/test_mailbox_step_graph_cuda.py runs them on a GPU."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moemesh.common.kernels import mailbox_gpu, mailbox_gpu_worker
from moemesh.common.kernels.mailbox_layout import LAYER_BITS, MailboxError, Word

HOPPER = GPUTarget("cuda", 90, 32)
WORDS = {"DISPATCH_SEQ_WORD": int(Word.DISPATCH_SEQ), "NUM_ROWS_WORD": int(Word.NUM_ROWS), "LAYER_SHIFT": LAYER_BITS}
KERNELS = {
    "post_slot": (mailbox_gpu._post_slot_kernel, {
        "hidden_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32", "slot_hidden_ptr": "*bf16",
        "slot_ids_ptr": "*i32", "slot_weights_ptr": "*fp32", "words_ptr": "*i64", "blocks_done_ptr": "*i64",
        "epoch_ptr": "*i64", "layer": "i32", "num_rows": "i32", "hidden_size": "i32", "top_k": "i32"},
        {"num_row_blocks": 4, **WORDS, "BLOCK_D": 1024, "BLOCK_K": 8}, ("st.release.sys", "fence.sc.sys")),
    "wait_done": (mailbox_gpu._wait_done_kernel, {
        "words_ptr": "*i64", "epoch_ptr": "*i64", "step_errors_ptr": "*i64", "layer": "i32", "worker_index": "i32",
        "timeout_ns": "i64"},
        {"DONE_SEQ_WORD": int(Word.DONE_SEQ), "WAIT_ERROR_WORD": int(Word.WAIT_ERROR), "LAYER_SHIFT": LAYER_BITS,
         "TIMEOUT_CODE": int(MailboxError.TIMEOUT), "PROTOCOL_CODE": int(MailboxError.PROTOCOL)},
        ("ld.acquire.sys", "%globaltimer")),
    "post_rows_word": (mailbox_gpu._post_rows_word_kernel, {
        "words_ptr": "*i64", "epoch_ptr": "*i64", "layer": "i32", "num_rows": "i32"}, WORDS, ("st.release.sys",)),
    "take_dispatch": (mailbox_gpu_worker._take_dispatch_kernel, {
        "words_ptr": "*i64", "state_ptr": "*i64", "layer": "i32", "timeout_ns": "i64"},
        {**WORDS, "TIMEOUT_CODE": 1, "SUPERSEDED_CODE": 2}, ("ld.acquire.sys", "%globaltimer")),
    "release_done": (mailbox_gpu_worker._release_done_kernel, {
        "words_ptr": "*i64", "state_ptr": "*i64", "served_ptr": "*i64", "layer": "i32"},
        {"DONE_SEQ_WORD": int(Word.DONE_SEQ), "LAYER_SHIFT": LAYER_BITS}, ("st.release.sys", "fence.sc.sys")),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_mailbox_kernel_compiles_for_hopper_with_its_memory_ordering(name):
    kernel, signature, constants, instructions = KERNELS[name]
    signature = {**signature, **{key: "constexpr" for key in constants}}
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constants), target=HOPPER)
    ptx = compiled.asm["ptx"]
    for instruction in instructions:
        assert instruction in ptx, f"{name}: no {instruction} in its PTX"
