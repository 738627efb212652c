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

from headlab._lazy import callable_module, lazy_exports

_EXPORTS = {  # module -> the names it exports
    "headlab.importance.ablation": ("Ablation", "METRICS", "compute_ablation"),
    "headlab.importance.agreement": ("AgreementTable", "compute_agreement", "spearman", "top_share"),
    "headlab.importance.confidence": ("Confidence", "compute_confidence"),
    # The data and the model's description live below the features; exported here too, as documented.
    "headlab.data.inputs": ("ImportanceData", "encode_texts", "make_batches", "read_data", "translate_data"),
    "headlab.model_description": ("ModelInfo", "describe_model"),
    "headlab.importance.gradient": ("Gradient", "compute_gradient", "l2_normalize_per_layer"),
    "headlab.importance.lrp": ("LRP", "STRATEGIES", "compute_lrp", "head_relevance"),
    "headlab.importance.measure": ("ImportanceMeasure",),
    "headlab.importance.config": ("ImportanceConfig",),
    "headlab.importance.pipeline": ("ImportanceResult", "run_importance", "save_results"),
    "headlab.importance.registry": ("MEASURES",),
    "headlab.importance.rules": ("lrp_rules",),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

# headlab.importance(model, ...) is the API's headlab.api.importance
callable_module(__name__, "headlab.api.importance")
