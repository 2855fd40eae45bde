"""The attention worker's side of the end of the router's start-time warm-up (services/router/warm_up.py).

The warm-up's synthetic steps ran like any others: their kernels compiled, their CUDA graphs were captured
(services/attention/graph_decode.py), and their routed tokens were counted. `end_warm_up` drops those
counts (placement is planned from real traffic only: `--routing-stats-out`, the routing summaries the
router shows) and reports what the decode graphs hold now. Nothing else is reset: the KV blocks the
synthetic requests wrote are free in the router's fresh scheduler, which restores no prefix from them.
"""

from __future__ import annotations

import structlog

from moemesh.common.wire.messages import WarmUpEnded

log = structlog.get_logger("attention")


def end_warm_up(worker) -> WarmUpEnded:
    """worker: the AttentionWorker (its `routing` counter and `runner.graphs`, None without CUDA graphs)."""
    worker.routing.forget()
    graphs = worker.runner.graphs
    stats = graphs.stats if graphs is not None else None
    ended = WarmUpEnded(num_graph_captures=stats.num_captures if stats else 0,
                        num_graph_steps=stats.num_graph_steps if stats else 0,
                        num_eager_steps=stats.num_eager_steps if stats else 0)
    log.info("attention.warm_up_ended", num_graph_captures=ended.num_graph_captures,
             num_graph_steps=ended.num_graph_steps, num_eager_steps=ended.num_eager_steps,
             eager_reasons=dict(stats.eager_reasons) if stats else {})
    return ended
