"""The length limit read from a model: the longest input its position table really takes."""

import pytest
import torch

from headlab.model_description import describe_model, model_max_length
from support.models import FAMILIES, SEQ2SEQ, tiny_model


def test_roberta_limit_leaves_out_the_reserved_positions():
    # RoBERTa numbers positions from padding_idx + 1 = 2: a table of 70 rows takes 68 tokens. The
    # limit used to be 70 without a tokenizer, and a 70-token input crashed in the embeddings.
    model = tiny_model("roberta").eval()
    info = describe_model(model)
    assert info.max_length == model_max_length(model, None) == 68
    with torch.no_grad():
        model(input_ids=torch.full((1, info.max_length), 5))
        with pytest.raises((IndexError, RuntimeError)):
            model(input_ids=torch.full((1, info.max_length + 1), 5))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in SEQ2SEQ and f != "roberta"])
def test_limit_is_the_position_table(family):
    model = tiny_model(family)
    assert describe_model(model).max_length == model_max_length(model, None) == 64


def test_offset_sinusoidal_table_reserves_nothing():
    # M2M100 (NLLB) numbers positions from padding_idx + 1 too, but its sinusoidal table has
    # max_position_embeddings + 2 rows (and grows on demand): all max_position_embeddings positions
    # are usable, as they were before RoBERTa's reserved rows were counted.
    import transformers as tf

    config = tf.M2M100Config(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
                             max_position_embeddings=12, pad_token_id=1, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = tf.M2M100ForConditionalGeneration(config).eval()
    assert describe_model(model).max_length == model_max_length(model, None) == 12
    ids = torch.full((1, 12), 5)
    with torch.no_grad():
        model(input_ids=ids, decoder_input_ids=ids)


def test_module_level_position_numbering_reserves_rows_too():
    # ESM numbers positions from padding_idx + 1 with a module-level create_position_ids_from_input_ids
    # (not a method of its embeddings): a table of 12 rows takes 10 tokens. The limit was 12, and an
    # input of 11 or 12 tokens crashed in the embeddings.
    import transformers as tf

    config = tf.EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=37, max_position_embeddings=12, pad_token_id=1, mask_token_id=32,
                          position_embedding_type="absolute")
    torch.manual_seed(0)
    model = tf.EsmForMaskedLM(config).eval()
    assert describe_model(model).max_length == model_max_length(model, None) == 10
    with torch.no_grad():
        model(input_ids=torch.full((1, 10), 5))
        with pytest.raises((IndexError, RuntimeError)):
            model(input_ids=torch.full((1, 11), 5))


def test_training_cuts_to_the_position_table_without_robertas_reserved_rows():
    """position_limit (what training's encode_corpus cuts to) leaves out RoBERTa's reserved rows (its positions
    start after the padding id: 514 rows hold 512 tokens), as describe_model's max_length does; before, training
    cut to the raw max_position_embeddings and a 513-token sequence ran past the table."""
    import transformers as tf

    from headlab.model_description import describe_model, position_limit

    config = tf.RobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, max_position_embeddings=18, pad_token_id=1)
    model = tf.RobertaForMaskedLM(config).eval()
    assert position_limit(model) == describe_model(model).max_length == 16
    ids = torch.randint(3, 40, (1, position_limit(model)))
    model(input_ids=ids)  # the longest sequence kept runs
    with pytest.raises((IndexError, RuntimeError)):  # index out of range in the position table
        model(input_ids=torch.randint(3, 40, (1, 18)))  # the raw count does not
    bare = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=24))
    assert position_limit(bare) == 24
