"""MCN losses: MMS contrastive, online-k-means cluster CE, reconstruction, and their weighted sum.

Imports only torch, raymcn.config (LossConfig, the modality names) and raymcn.collectives, through which
all cross-rank communication goes.
"""

from raymcn.losses.cluster import Clustering, FeatureQueue, assign_clusters, cluster_ce, cosine_kmeans
from raymcn.losses.contrastive import PAIRS, margin_cross_entropy, mms_loss
from raymcn.losses.objective import Layout, MCNObjective, StepRows
from raymcn.losses.recon import recon_loss

__all__ = [
    "PAIRS", "Clustering", "FeatureQueue", "Layout", "MCNObjective", "StepRows", "assign_clusters", "cluster_ce",
    "cosine_kmeans", "margin_cross_entropy", "mms_loss", "recon_loss",
]
