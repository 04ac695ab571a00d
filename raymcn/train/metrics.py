"""Zero-shot text-to-video retrieval metrics, chunked, in fp32.

Scores are ``M = t · (v + a)ᵀ``. The rank of query i is the number of gallery items scoring
*strictly* higher than its own match, so ties never push a correct match down (the original's
``np.where`` equality search misaligns on ties).
"""

from __future__ import annotations

import numpy as np
import torch

from raymcn.config import METRIC_PREFIX


def ranks_of_matches(queries: torch.Tensor, gallery: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """0-based rank of each query's own gallery item (the diagonal).

    Args:
        queries: (N, D) query embeddings (text).
        gallery: (N, D) gallery embeddings (video + audio); row i matches query i.
        chunk: queries scored at a time, so peak memory is chunk × N scores, not N × N.

    Returns:
        (N,) int64: number of gallery items with a strictly greater score than the match.
    """
    q = queries.float()
    g = gallery.float()
    out = torch.empty(q.shape[0], dtype=torch.long)
    for start in range(0, q.shape[0], chunk):
        scores = q[start:start + chunk] @ g.T  # (c, N) fp32
        idx = torch.arange(start, start + scores.shape[0])
        own = scores[torch.arange(scores.shape[0]), idx].unsqueeze(1)
        out[start:start + scores.shape[0]] = (scores > own).sum(dim=1).cpu()
    return out


def retrieval_metrics(ranks: torch.Tensor, num_queries_total: int | None = None,
                      prefix: str = METRIC_PREFIX) -> dict[str, float]:
    """R@1/5/10 (percent) and MedR from 0-based ranks.

    Args:
        ranks: (N,) 0-based ranks of the queries that are present.
        num_queries_total: denominator for R@K. MSR-VTT's protocol fixes it at 1000 although only
            968 clips have audio, so the missing ones count as misses; MedR stays over the present
            queries, as in the original.
    """
    r = ranks.cpu().numpy()
    total = num_queries_total or len(r)
    out = {f"{prefix}_R@{k}": 100.0 * float((r < k).sum()) / total for k in (1, 5, 10)}
    out[f"{prefix}_MedR"] = float(np.median(r)) + 1.0
    return out
