"""MCN losses: MMS contrastive, online-k-means cluster CE, reconstruction, and their weighted sum.

Imports only torch and raymcn.config (LossConfig, the modality names). All cross-rank communication goes through
:mod:`raymcn.losses.gather`.
"""

from raymcn.losses.cluster import FeatureQueue, assign_clusters, cluster_ce, cosine_kmeans
from raymcn.losses.contrastive import PAIRS, margin_cross_entropy, mms_loss
from raymcn.losses.gather import Collectives, world_info
from raymcn.losses.objective import MCNObjective
from raymcn.losses.recon import recon_loss

__all__ = [
    "Collectives", "FeatureQueue", "MCNObjective", "PAIRS", "assign_clusters", "cluster_ce", "cosine_kmeans",
    "margin_cross_entropy", "mms_loss", "recon_loss", "world_info",
]
