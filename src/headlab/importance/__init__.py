"""Head importance, four ways, in one HeadScores table each.

* :func:`compute_confidence` - mean maximum attention weight, EOS excluded (Voita et al. 2019, Sec. 4);
* :func:`compute_lrp` - layer-wise relevance propagation of the top-1 logit, the paper's rules
  (Voita et al. 2019, Sec. 4 and App. A; Ding et al. 2017), as a modified backward pass
  (:func:`lrp_rules`) with all generation steps in one batched backward;
* :func:`compute_gradient` - expected absolute gate gradient (Michel et al. 2019);
* :func:`compute_ablation` - the ground truth: the loss (or BLEU) change when one head is masked;
* :func:`compute_agreement` - Spearman correlation of each measure with ablation, per kind.

Each is an :class:`ImportanceMeasure` in the registry :data:`MEASURES`; :func:`run_importance`
runs them on prepared data (``headlab importance`` on the command line).
"""

from headlab._lazy import lazy_exports

_EXPORTS = {
    "Ablation": "headlab.importance.ablation",
    "METRICS": "headlab.importance.ablation",
    "compute_ablation": "headlab.importance.ablation",
    "AgreementTable": "headlab.importance.agreement",
    "compute_agreement": "headlab.importance.agreement",
    "spearman": "headlab.importance.agreement",
    "top_share": "headlab.importance.agreement",
    "Confidence": "headlab.importance.confidence",
    "compute_confidence": "headlab.importance.confidence",
    "ImportanceData": "headlab.importance.data",
    "ModelInfo": "headlab.importance.data",
    "describe_model": "headlab.importance.data",
    "encode_texts": "headlab.importance.data",
    "make_batches": "headlab.importance.data",
    "read_data": "headlab.importance.data",
    "translate_data": "headlab.importance.data",
    "Gradient": "headlab.importance.gradient",
    "compute_gradient": "headlab.importance.gradient",
    "l2_normalize_per_layer": "headlab.importance.gradient",
    "LRP": "headlab.importance.lrp",
    "STRATEGIES": "headlab.importance.lrp",
    "compute_lrp": "headlab.importance.lrp",
    "head_relevance": "headlab.importance.lrp",
    "ImportanceMeasure": "headlab.importance.measure",
    "ImportanceConfig": "headlab.importance.config",
    "ImportanceResult": "headlab.importance.pipeline",
    "run_importance": "headlab.importance.pipeline",
    "save_results": "headlab.importance.pipeline",
    "MEASURES": "headlab.importance.registry",
    "lrp_rules": "headlab.importance.rules",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
