"""What the workers' decode-step CUDA graphs replay, shared with the router (imports no torch): the token buckets
a step graph is captured for, and the longest chunk one sequence brings to a graphed step. The attention worker
(services/attention/graph_decode.py) and the expert workers (services/expert/graphs.py) capture these buckets; the
router's warm-up visits them (warm_up_plan.py) and its scheduler sizes short prefills to the chunk
(scheduler/budget.py)."""

from __future__ import annotations

from moemesh.common.model.kv_sizing import DEFAULT_MAX_ROLLBACK_TOKENS

DECODE_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tokens of a graphed step (micro-batch), ascending
# new tokens a sequence may bring to a graphed step: a seed and up to 7 drafts, or a prefill chunk. No more than the
# rings' rollback reach, so a prefix-cache block end crossed by the chunk is still in the rings for its snapshot
GRAPH_CHUNK_TOKENS = DEFAULT_MAX_ROLLBACK_TOKENS
