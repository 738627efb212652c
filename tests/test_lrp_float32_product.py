"""The gated MLP's product rule passes on all of ``down``'s input relevance, also where the MLP computes its product in
another precision than the model: Beam evaluates ``act(gate) * up`` in float32 within a float64 model (transformers
5.24). Found by the session-39 variant sweep (``experiments/variant_sweep.py``, Beam with ``sliding_window=4``: FAIL
``lrp``, relevance 2.469 for a logit of 2.4678): the rule's backward was that of the product recomputed from the two
factors, not of the value the MLP computed, and the float32 rounding's share was lost, which relevances cancelling
across the layer (Beam's sandwich norms: shares of +-2000 summing to 2.5) made 4e-4 of the logit. Now the recomputed
product is scaled to the computed one (``rules._as_computed``). The test fails before the fix (relative difference
4.1e-4); float32 rounding inside the product rule's near-singular shares (``a + b`` near zero) still loses 5e-5 here.
"""

from __future__ import annotations

import pytest
import transformers as tf

from support.family_matrix import check_lrp_conserves, perturbed_model


def test_beams_float32_product_passes_on_its_relevance():
    if not hasattr(tf, "BeamForCausalLM"):
        pytest.skip("this transformers has no Beam")
    # no final cap (computed in float32 too), two dense layers, a sliding window of 4 tokens on the first
    config = tf.BeamConfig(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                           pad_token_id=2, final_logit_softcapping=None, sliding_window=4)
    model = perturbed_model(tf.BeamForCausalLM, config, attn_implementation="eager").double()
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-4, atol=1e-5)
