"""Head importance, four ways, in one HeadScores table each.

* :func:`compute_confidence` - mean maximum attention weight, EOS excluded (Voita et al. 2019, Sec. 4);
* :func:`compute_lrp` - layer-wise relevance propagation of the top-1 logit, the paper's rules
  (Voita et al. 2019, Sec. 4 and App. A; Ding et al. 2017), as a modified backward pass
  (:func:`lrp_rules`) with all generation steps in one batched backward;
* :func:`compute_gradient` - expected absolute gate gradient (Michel et al. 2019);
* :func:`compute_ablation` - the ground truth: the loss (or BLEU) change when one head is masked;
* :func:`compute_agreement` - Spearman correlation of each measure with ablation, per kind.

:func:`run_importance` runs them all on prepared data (``headlab importance`` on the command line).
"""

from headlab.importance.ablation import METRICS, compute_ablation
from headlab.importance.agreement import AgreementTable, compute_agreement, spearman, top_share
from headlab.importance.confidence import compute_confidence
from headlab.importance.data import (
    ImportanceData,
    ModelInfo,
    describe_model,
    encode_texts,
    make_batches,
    read_data,
    translate_data,
)
from headlab.importance.gradient import compute_gradient, l2_normalize_per_layer
from headlab.importance.lrp import STRATEGIES, compute_lrp, head_relevance
from headlab.importance.pipeline import METHODS, ImportanceConfig, ImportanceResult, run_importance, save_results
from headlab.importance.rules import lrp_rules

__all__ = [
    "METHODS",
    "METRICS",
    "STRATEGIES",
    "AgreementTable",
    "ImportanceConfig",
    "ImportanceData",
    "ImportanceResult",
    "ModelInfo",
    "compute_ablation",
    "compute_agreement",
    "compute_confidence",
    "compute_gradient",
    "compute_lrp",
    "describe_model",
    "encode_texts",
    "head_relevance",
    "l2_normalize_per_layer",
    "lrp_rules",
    "make_batches",
    "read_data",
    "run_importance",
    "save_results",
    "spearman",
    "top_share",
    "translate_data",
]
