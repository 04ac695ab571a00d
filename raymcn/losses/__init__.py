"""MCN losses: MMS contrastive, online-k-means cluster CE, reconstruction, and their weighted sum.

Imports only torch and raymcn.config. All cross-rank communication goes through
:mod:`raymcn.losses.gather`.
"""

from raymcn.losses.cluster import FeatureQueue, assign_clusters, cluster_ce, cosine_kmeans
from raymcn.losses.contrastive import PAIRS, margin_cross_entropy, mms_loss
from raymcn.losses.gather import all_gather_no_grad, all_reduce_mean, broadcast_from_rank0, world_info
from raymcn.losses.objective import MCNObjective
from raymcn.losses.recon import recon_loss

__all__ = [
    "FeatureQueue", "MCNObjective", "PAIRS", "all_gather_no_grad", "all_reduce_mean", "assign_clusters",
    "broadcast_from_rank0", "cluster_ce", "cosine_kmeans", "margin_cross_entropy", "mms_loss", "recon_loss",
    "world_info",
]
