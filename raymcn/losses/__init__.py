"""MCN losses: MMS contrastive, online-k-means cluster CE, reconstruction, and their weighted sum.

Imports only torch, raymcn.config (LossConfig, the modality names) and raymcn.collectives, through which
all cross-rank communication goes.
"""

from raymcn.losses.cluster import FeatureQueue, assign_clusters, cluster_ce, cosine_kmeans
from raymcn.losses.contrastive import PAIRS, margin_cross_entropy, mms_loss
from raymcn.losses.objective import MCNObjective
from raymcn.losses.recon import recon_loss

__all__ = [
    "FeatureQueue", "MCNObjective", "PAIRS", "assign_clusters", "cluster_ce", "cosine_kmeans",
    "margin_cross_entropy", "mms_loss", "recon_loss",
]
