/* The CPU expert mailbox: one segment of shared host memory per (waiting side, expert worker) pair.
 *
 * The layout is defined twice, here and in common/kernels/mailbox_layout.py; cpu_mailbox.py compares
 * the two when it loads the library (moemesh_mailbox_abi / moemesh_mailbox_layout), and the worker
 * thread compares the header of the segment it is given with its own computation before serving.
 * docs/device-step.md describes the protocol.
 *
 * Control page (MB_CONTROL_BYTES), int64 words; each group of words written by one side sits on its
 * own 128-byte line (two cache lines: adjacent-line prefetch never couples the two sides):
 *   header (creator, once):      magic, version, t_max, hidden, top_k, hidden_bf16, combine_slots,
 *                                total_bytes, offsets of the four data regions, worker index
 *   dispatch line (waiting side): dispatch_seq (release store), num_rows T (plain, before the release)
 *   completion line (worker):     done_seq (release store), error code / seq / detail (plain, before it)
 *   wait-error line (waiting side): code / seq / done value seen / worker index of a wait that timed out
 *   control line:                 stop word (any nonzero value stops the worker loop)
 *   status line (worker):         pid, state, attach seq, layers served, time spent serving (all, last layer)
 * Data regions (page aligned): hidden [t_max, hidden] fp32 or bf16 | ids [t_max, top_k] int32 |
 *   weights [t_max, top_k] fp32 | combine: partial sums [t_max, hidden] fp32, or per-slot outputs
 *   [t_max, top_k, hidden] fp32 (combine_slots = 1).
 *
 * Sequence numbers: seq = epoch << 16 | layer, epoch >= 1, so they only grow along a run of steps.
 */
#ifndef MOEMESH_CPU_MAILBOX_H
#define MOEMESH_CPU_MAILBOX_H

#include <stdint.h>

#define MB_MAGIC 0x31584f424d454f4dLL /* "MOEMBOX1" little-endian */
#define MB_VERSION 1
#define MB_PAGE 4096
#define MB_CONTROL_BYTES 4096
#define MB_LAYER_BITS 16
#define MB_MAX_LAYERS (1 << MB_LAYER_BITS)

/* header words (byte offsets into the control page) */
#define MB_OFF_MAGIC 0
#define MB_OFF_VERSION 8
#define MB_OFF_T_MAX 16
#define MB_OFF_HIDDEN_SIZE 24
#define MB_OFF_TOP_K 32
#define MB_OFF_HIDDEN_BF16 40
#define MB_OFF_COMBINE_SLOTS 48
#define MB_OFF_TOTAL_BYTES 56
#define MB_OFF_REGION_HIDDEN 64
#define MB_OFF_REGION_IDS 72
#define MB_OFF_REGION_WEIGHTS 80
#define MB_OFF_REGION_COMBINE 88
#define MB_OFF_WORKER_INDEX 96
/* dispatch line: written by the waiting side */
#define MB_OFF_DISPATCH_SEQ 128
#define MB_OFF_NUM_ROWS 136
/* completion line: written by the worker */
#define MB_OFF_DONE_SEQ 256
#define MB_OFF_WORKER_ERROR 264
#define MB_OFF_WORKER_ERROR_SEQ 272
#define MB_OFF_WORKER_ERROR_DETAIL 280
/* wait-error line: written by the waiting side */
#define MB_OFF_WAIT_ERROR 384
#define MB_OFF_WAIT_ERROR_SEQ 392
#define MB_OFF_WAIT_ERROR_SEEN 400
#define MB_OFF_WAIT_ERROR_WORKER 408
/* control line */
#define MB_OFF_STOP 512
/* status line: written by the worker */
#define MB_OFF_WORKER_PID 640
#define MB_OFF_WORKER_STATE 648
#define MB_OFF_ATTACH_SEQ 656
#define MB_OFF_SERVED 664
#define MB_OFF_BUSY_NS 672 /* total time spent serving layers (ns) */
#define MB_OFF_LAST_BUSY_NS 680 /* time spent serving the last layer (ns), written before done_seq */

/* error codes (worker error word and wait-error word) */
enum {
    MB_OK = 0,
    MB_ERR_TIMEOUT = 1,     /* waiting side: no completion within the bound */
    MB_ERR_BAD_LAYER = 2,   /* worker: layer of the seq >= the placement's layer count */
    MB_ERR_BAD_ROWS = 3,    /* worker: T outside 0..t_max */
    MB_ERR_BAD_EXPERT = 4,  /* worker: an id outside 0..num_experts-1 (detail: the slot) */
    MB_ERR_KERNEL = 5,      /* worker: the FP4 kernel failed (detail: its status) */
    MB_ERR_PROTOCOL = 6,    /* waiting side: the completion seq passed the one it waited for */
};

/* worker states (status line) */
enum { MB_STATE_DETACHED = 0, MB_STATE_WAITING = 1, MB_STATE_COMPUTING = 2, MB_STATE_STOPPED = 3 };

/* A layer's stacked FP4 experts owned by this worker (cpu_fp4.c's stacks; NULL where it owns none). */
typedef struct {
    const uint8_t *w1, *s1, *w3, *s3, *w2, *s2;
    int64_t w13_stride, s13_stride, w2_stride, s2_stride; /* bytes between experts */
} mb_layer_stacks;

/* cpu_fp4.c, linked into the same library */
void moemesh_fp4_init(void);
int moemesh_fp4_experts_routed(const void *hidden, int hidden_is_bf16, int64_t hidden_size, int64_t inter_size,
                               int64_t num_tokens, int64_t top_k, const int64_t *ids, const float *weights,
                               const uint8_t *slot_mask, const int64_t *local, int64_t num_routed,
                               const uint8_t *w1, const uint8_t *s1, const uint8_t *w3, const uint8_t *s3,
                               int64_t w13_stride, int64_t s13_stride, const uint8_t *w2, const uint8_t *s2,
                               int64_t w2_stride, int64_t s2_stride, int has_limit, float swiglu_limit,
                               int route_before_w2, float *out, int num_threads, int executor);

#endif
