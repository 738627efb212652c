"""The causal language model inside a multimodal wrapper, for a wrapper headlab refuses as a whole.

Some vision-language wrappers hold a language model that headlab supports through a family table (its attention laid
out by a table, not discovered: Qwen3.5's gated queries), but the generic discovery, looking at the whole wrapper,
cannot replace that table and refuses it (:func:`headlab.adapters.attention_blocks`, naming the language model). For
Qwen3.5 itself transformers loads the checkpoint as ``Qwen3_5ForCausalLM``; for MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR
(their text model ``qwen3_5_text``) it has no causal-LM class for the wrapper's type, so a user had no way in.

:func:`language_model_of` builds transformers' own causal LM for the wrapper's text config around the wrapper's
language model and LM head (the same modules: no copy, tied weights stay tied). Token ids never run a tower, so on
them the wrapper is that language model; :func:`check_same_logits` checks it on the loaded weights (bit for bit,
padded batch included) before anything is analysed, and a wrapper that adds anything on the way is refused.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from headlab.adapters import attention_blocks
from headlab.checkpoint import listed_classes
from headlab.errors import HeadlabError
from headlab.options import checked_keywords

__all__ = ["language_model_of", "check_same_logits", "analysed_model"]


@checked_keywords()
def language_model_of(model: nn.Module) -> nn.Module | None:
    """``model``'s language model as transformers' ``AutoModelForCausalLM`` class for its text config, holding the
    wrapper's own language model and LM head; None where ``model`` is no such wrapper (no text sub-config, no causal-LM
    class for it, not exactly one module of that class's inner model type, or an LM head of another shape). Built on
    the meta device, then given the wrapper's modules: it shares their device and dtype."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else None
    classes = listed_classes("AutoModelForCausalLM", text) if text is not None and text is not config else ()
    if not classes:
        return None
    cls = cast(Any, classes[0])
    try:
        with torch.device("meta"):
            causal = cls(text)
    except (ValueError, TypeError, AttributeError, NotImplementedError):
        return None
    prefix = getattr(causal, "base_model_prefix", "")
    inner = getattr(causal, prefix, None) if prefix else None
    if not isinstance(inner, nn.Module):
        return None
    found = [m for m in model.modules() if type(m) is type(inner)]
    head, own_head = cast(Any, model).get_output_embeddings(), causal.get_output_embeddings()
    if len(found) != 1 or not isinstance(head, nn.Module) or not isinstance(own_head, nn.Module) \
            or type(head) is not type(own_head) or getattr(head, "weight", None) is None \
            or head.weight.shape != own_head.weight.shape:
        return None
    setattr(causal, prefix, found[0])
    causal.set_output_embeddings(head)
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    if not all(id(t) in own for t in (*causal.parameters(), *causal.buffers())):
        return None  # a part of the causal LM the wrapper does not have: not its language model
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        causal.generation_config = generation
    return causal.eval() if not model.training else causal


def check_same_logits(wrapper: nn.Module, causal: nn.Module, source: str) -> None:
    """The language model gives the wrapper's logits, bit for bit, on a padded batch of token ids (what headlab's
    commands give a model): otherwise the wrapper does more on token ids than its language model, and is refused."""
    vocab = int(cast(Any, causal).get_output_embeddings().weight.shape[0])
    device = next(causal.parameters()).device
    ids = (torch.arange(2 * 6, device=device).view(2, 6) * 7 + 3) % max(vocab, 1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as batches of a causal LM are padded
    with torch.no_grad():
        expected = wrapper(input_ids=ids, attention_mask=mask).logits
        got = causal(input_ids=ids, attention_mask=mask).logits
    if not torch.equal(expected[mask.bool()], got[mask.bool()]):
        difference = (expected - got)[mask.bool()].abs().max().item()
        raise HeadlabError(
            f"{source}: {type(wrapper).__name__}'s language model ({type(causal).__name__}, which headlab analyses) does "
            f"not give the wrapper's logits on token ids (largest difference {difference:.3g}): the wrapper does more "
            "than its language model on text, which headlab has not checked")


def analysed_model(model: nn.Module) -> tuple[nn.Module, bool]:
    """``model``, or, where headlab refuses it as a whole but supports the language model inside it
    (:func:`language_model_of`), that language model; and whether it is the language model. Where both are
    refused, the wrapper's refusal is raised."""
    try:
        attention_blocks(model)
        return model, False
    except HeadlabError as error:
        refusal = error
    causal = language_model_of(model)
    if causal is None:
        raise refusal
    try:
        attention_blocks(causal)
    except HeadlabError:
        raise refusal from None
    return causal, True
