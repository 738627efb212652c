"""A brute-force LRP reference, written independently of headlab's implementation.

It re-implements the forward pass of tiny Marian, BART, BERT and GPT-2 models from their
weights (float64, one sentence at a time, no autograd) and propagates relevance backwards
neuron by neuron with the weight ratios of Voita et al. 2019, Appendix A.2 (Ding et al. 2017):

* weighted sum ``y_j = sum_i W_ji x_i + b_j``: ``R(x_i) = sum_j W_ji x_i / y_j * R(y_j)``
  (the bias is its own incoming neuron and keeps its share);
* non-linear activations: ``R(x) = R(f(x))``;
* residual sums ``y = a + b``: ``R(a) = a / y * R(y)``;
* layer norm: ``c = x - mean(x)`` is a weighted sum; ``y = c * gamma / std + beta`` is a
  one-input weighted sum with weight ``gamma / std`` and bias ``beta``;
* attention: ``head_q = sum_k p_qk v_k`` with the attention weights as the weights of the sum;
  queries and keys receive no relevance.

Every contribution ``z_ji`` is materialised explicitly; nothing here computes a gradient.
"""

from __future__ import annotations

import math

import torch


# -- rules, neuron by neuron ------------------------------------------------------------------
def linear(x, weight, bias):
    """y = x W^T + b with W [out, in]."""
    y = x @ weight.T
    return y + bias if bias is not None else y


def rel_linear(x, weight, bias, r_y):
    """R(x_i) = sum_j (W_ji x_i / y_j) R(y_j); x [n, in], W [out, in]."""
    y = linear(x, weight, bias)  # [n, out]
    z = weight[None, :, :] * x[:, None, :]  # [n, out, in]: contribution of x_i to y_j
    return (z / y[:, :, None] * r_y[:, :, None]).sum(1)


def rel_add(a, b, r_y):
    y = a + b
    return a / y * r_y, b / y * r_y


def layer_norm(x, gamma, beta, eps):
    c = x - x.mean(-1, keepdim=True)
    std = torch.sqrt((c**2).mean(-1, keepdim=True) + eps)
    return c / std * gamma + beta


def rel_layer_norm(x, gamma, beta, eps, r_y):
    n = x.shape[-1]
    c = x - x.mean(-1, keepdim=True)
    std = torch.sqrt((c**2).mean(-1, keepdim=True) + eps)
    y = c * (gamma / std) + beta
    r_c = c * (gamma / std) / y * r_y  # one-input weighted sum, beta keeps its share
    centering = torch.eye(n, dtype=x.dtype) - 1.0 / n  # c_j = sum_i C_ji x_i
    z = centering[None, :, :] * x[:, None, :]  # [pos, j, i]
    return (z / c[:, :, None] * r_c[:, :, None]).sum(1)


def attention(q, k, v, n_heads, scale, allowed):
    """q [nq, d], k/v [nk, d] -> heads [nq, H, dh], probs [H, nq, nk]."""
    d_head = q.shape[-1] // n_heads
    qh, kh, vh = (t.view(t.shape[0], n_heads, d_head).transpose(0, 1) for t in (q, k, v))
    scores = qh @ kh.transpose(1, 2) * scale
    scores = scores.masked_fill(~allowed[None], -math.inf)
    probs = scores.softmax(-1)  # [H, nq, nk]
    heads = (probs @ vh).transpose(0, 1)  # [nq, H, dh]
    return heads, probs


def rel_attention_values(probs, v, n_heads, r_heads):
    """R(v_kd) = sum_q p_qk v_kd / head_qd * R(head_qd) for every head; v [nk, d]."""
    d_head = v.shape[-1] // n_heads
    vh = v.view(v.shape[0], n_heads, d_head)  # [nk, H, dh]
    heads = torch.einsum("hqk,khd->qhd", probs, vh)
    z = probs.permute(1, 2, 0)[:, :, :, None] * vh[None]  # [nq, nk, H, dh]
    r_v = (z / heads[:, None] * r_heads[:, None]).sum(0)  # [nk, H, dh]
    return r_v.reshape(v.shape)


# -- models -----------------------------------------------------------------------------------
def _w(module):
    return module.weight.detach().double()


def _b(module):
    return None if module.bias is None else module.bias.detach().double()


class PostNormSeq2Seq:
    """Marian / BART: post-norm encoder-decoder layers."""

    def __init__(self, model):
        self.m = model
        self.core = model.model
        self.config = model.config
        self.bart = model.config.model_type == "bart"

    def _embed(self, stack, ids):
        config = self.config
        scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        x = stack.embed_tokens.weight.detach().double()[ids] * scale
        positions = torch.arange(len(ids))
        if self.bart:
            x = x + stack.embed_positions.weight.detach().double()[positions + 2]
            ln = stack.layernorm_embedding
            x = layer_norm(x, _w(ln), _b(ln), ln.eps)
        else:
            x = x + stack.embed_positions.weight.detach().double()[positions]
        return x

    def _attn(self, module, h_q, h_kv, allowed):
        q, k, v = (linear(h, _w(p), _b(p)) for h, p in ((h_q, module.q_proj), (h_kv, module.k_proj), (h_kv, module.v_proj)))
        heads, probs = attention(q, k, v, module.num_heads, module.head_dim**-0.5, allowed)
        out = linear(heads.reshape(heads.shape[0], -1), _w(module.out_proj), _b(module.out_proj))
        return out, {"heads": heads, "probs": probs, "v": v, "h_kv": h_kv, "module": module}

    def _rel_attn(self, cache, r_out):
        module, heads = cache["module"], cache["heads"]
        flat = heads.reshape(heads.shape[0], -1)
        r_heads = rel_linear(flat, _w(module.out_proj), _b(module.out_proj), r_out).view(heads.shape)
        r_v = rel_attention_values(cache["probs"], cache["v"], module.num_heads, r_heads)
        r_kv_input = rel_linear(cache["h_kv"], _w(module.v_proj), _b(module.v_proj), r_v)
        return r_heads.sum(dim=(0, 2)), r_kv_input

    def _ffn(self, layer, h):
        f1 = linear(h, _w(layer.fc1), _b(layer.fc1))
        g = layer.activation_fn(f1)
        return linear(g, _w(layer.fc2), _b(layer.fc2)), g

    def relevance(self, src, dec):
        """Head relevances for every decoder position of one sentence pair.

        Returns ``{(kind, layer): [n_dec, n_heads]}``, the target logits and tokens.
        """
        src, dec = list(src), list(dec)
        enc_layers, dec_layers = self.core.encoder.layers, self.core.decoder.layers
        # forward, encoder
        h = self._embed(self.core.encoder, src)
        allowed_enc = torch.ones(len(src), len(src), dtype=torch.bool)
        enc_cache = []
        for layer in enc_layers:
            a, c_attn = self._attn(layer.self_attn, h, h, allowed_enc)
            s1 = h + a
            ln1 = layer.self_attn_layer_norm
            h1 = layer_norm(s1, _w(ln1), _b(ln1), ln1.eps)
            f, g = self._ffn(layer, h1)
            s2 = h1 + f
            ln2 = layer.final_layer_norm
            enc_cache.append((h, a, s1, h1, f, g, s2, c_attn))
            h = layer_norm(s2, _w(ln2), _b(ln2), ln2.eps)
        enc_out = h
        # forward, decoder
        h = self._embed(self.core.decoder, dec)
        causal = torch.ones(len(dec), len(dec), dtype=torch.bool).tril()
        cross_allowed = torch.ones(len(dec), len(src), dtype=torch.bool)
        dec_cache = []
        for layer in dec_layers:
            a, c_self = self._attn(layer.self_attn, h, h, causal)
            s1 = h + a
            ln1 = layer.self_attn_layer_norm
            h1 = layer_norm(s1, _w(ln1), _b(ln1), ln1.eps)
            x, c_cross = self._attn(layer.encoder_attn, h1, enc_out, cross_allowed)
            s2 = h1 + x
            ln2 = layer.encoder_attn_layer_norm
            h2 = layer_norm(s2, _w(ln2), _b(ln2), ln2.eps)
            f, g = self._ffn(layer, h2)
            s3 = h2 + f
            ln3 = layer.final_layer_norm
            dec_cache.append((h, a, s1, h1, x, s2, h2, f, g, s3, c_self, c_cross))
            h = layer_norm(s3, _w(ln3), _b(ln3), ln3.eps)
        out_weight = self.m.lm_head.weight.detach().double()
        logits = h @ out_weight.T + self.m.final_logits_bias.detach().double()[0]
        tokens = logits.argmax(-1)
        results = {}
        target_logits = []
        for t in range(len(dec)):
            k = int(tokens[t])
            y = float(logits[t, k])
            target_logits.append(y)
            # R at the LM head input: only position t, R_z = W[k] z (bias shares absorbed)
            r_h = torch.zeros_like(h)
            r_h[t] = out_weight[k] * h[t]
            r_enc = torch.zeros_like(enc_out)
            for li in reversed(range(len(dec_layers))):
                layer = dec_layers[li]
                (h_in, a, s1, h1, x, s2, h2, f, g, s3, c_self, c_cross) = dec_cache[li]
                ln3, ln2, ln1 = layer.final_layer_norm, layer.encoder_attn_layer_norm, layer.self_attn_layer_norm
                r_s3 = rel_layer_norm(s3, _w(ln3), _b(ln3), ln3.eps, r_h)
                r_h2, r_f = rel_add(h2, f, r_s3)
                r_g = rel_linear(g, _w(layer.fc2), _b(layer.fc2), r_f)  # relevance of the activation output
                r_h2 = r_h2 + rel_linear(h2, _w(layer.fc1), _b(layer.fc1), r_g)  # activation ignored
                r_s2 = rel_layer_norm(s2, _w(ln2), _b(ln2), ln2.eps, r_h2)
                r_h1, r_x = rel_add(h1, x, r_s2)
                head_rel, r_enc_part = self._rel_attn(c_cross, r_x)
                results.setdefault(("dec_cross", li), []).append(head_rel)
                r_enc = r_enc + r_enc_part
                r_s1 = rel_layer_norm(s1, _w(ln1), _b(ln1), ln1.eps, r_h1)
                r_in, r_a = rel_add(h_in, a, r_s1)
                head_rel, r_in_part = self._rel_attn(c_self, r_a)
                results.setdefault(("dec_self", li), []).append(head_rel)
                r_h = r_in + r_in_part
            r_h = r_enc
            for li in reversed(range(len(enc_layers))):
                layer = enc_layers[li]
                (h_in, a, s1, h1, f, g, s2, c_attn) = enc_cache[li]
                ln2, ln1 = layer.final_layer_norm, layer.self_attn_layer_norm
                r_s2 = rel_layer_norm(s2, _w(ln2), _b(ln2), ln2.eps, r_h)
                r_h1, r_f = rel_add(h1, f, r_s2)
                r_g = rel_linear(g, _w(layer.fc2), _b(layer.fc2), r_f)
                r_h1 = r_h1 + rel_linear(h1, _w(layer.fc1), _b(layer.fc1), r_g)
                r_s1 = rel_layer_norm(s1, _w(ln1), _b(ln1), ln1.eps, r_h1)
                r_in, r_a = rel_add(h_in, a, r_s1)
                head_rel, r_in_part = self._rel_attn(c_attn, r_a)
                results.setdefault(("enc_self", li), []).append(head_rel)
                r_h = r_in + r_in_part
        return {k: torch.stack(v) for k, v in results.items()}, torch.tensor(target_logits), tokens


class Bert:
    """BERT for masked LM: post-norm encoder, MLM head (dense, act, LN, decoder)."""

    def __init__(self, model):
        self.m = model

    def relevance(self, ids):
        bert = self.m.bert
        emb = bert.embeddings
        ids = list(ids)
        n = len(ids)
        x = (emb.word_embeddings.weight.detach().double()[ids]
             + emb.position_embeddings.weight.detach().double()[torch.arange(n)]
             + emb.token_type_embeddings.weight.detach().double()[torch.zeros(n, dtype=torch.long)])
        h = layer_norm(x, _w(emb.LayerNorm), _b(emb.LayerNorm), emb.LayerNorm.eps)
        allowed = torch.ones(n, n, dtype=torch.bool)
        cache = []
        for layer in bert.encoder.layer:
            sa, so = layer.attention.self, layer.attention.output
            q, k, v = (linear(h, _w(p), _b(p)) for p in (sa.query, sa.key, sa.value))
            heads, probs = attention(q, k, v, sa.num_attention_heads, sa.attention_head_size**-0.5, allowed)
            a = linear(heads.reshape(n, -1), _w(so.dense), _b(so.dense))
            s1 = a + h
            h1 = layer_norm(s1, _w(so.LayerNorm), _b(so.LayerNorm), so.LayerNorm.eps)
            f1 = linear(h1, _w(layer.intermediate.dense), _b(layer.intermediate.dense))
            g = layer.intermediate.intermediate_act_fn(f1)
            f2 = linear(g, _w(layer.output.dense), _b(layer.output.dense))
            s2 = f2 + h1
            cache.append((h, heads, probs, v, a, s1, h1, g, f2, s2, layer))
            h = layer_norm(s2, _w(layer.output.LayerNorm), _b(layer.output.LayerNorm), layer.output.LayerNorm.eps)
        head = self.m.cls.predictions
        t1 = linear(h, _w(head.transform.dense), _b(head.transform.dense))
        t2 = head.transform.transform_act_fn(t1)
        z = layer_norm(t2, _w(head.transform.LayerNorm), _b(head.transform.LayerNorm), head.transform.LayerNorm.eps)
        out_w = head.decoder.weight.detach().double()
        logits = linear(z, out_w, head.decoder.bias.detach().double())
        tokens = logits.argmax(-1)
        results, target_logits = {}, []
        for t in range(n):
            k = int(tokens[t])
            target_logits.append(float(logits[t, k]))
            r_z = torch.zeros_like(z)
            r_z[t] = out_w[k] * z[t]
            r_t2 = rel_layer_norm(t2, _w(head.transform.LayerNorm), _b(head.transform.LayerNorm),
                                  head.transform.LayerNorm.eps, r_z)
            r_h = rel_linear(h, _w(head.transform.dense), _b(head.transform.dense), r_t2)
            for li in reversed(range(len(cache))):
                (h_in, heads, probs, v, a, s1, h1, g, f2, s2, layer) = cache[li]
                out_ln = layer.output.LayerNorm
                r_s2 = rel_layer_norm(s2, _w(out_ln), _b(out_ln), out_ln.eps, r_h)
                r_f2, r_h1 = rel_add(f2, h1, r_s2)
                r_g = rel_linear(g, _w(layer.output.dense), _b(layer.output.dense), r_f2)
                r_h1 = r_h1 + rel_linear(h1, _w(layer.intermediate.dense), _b(layer.intermediate.dense), r_g)
                so, sa = layer.attention.output, layer.attention.self
                r_s1 = rel_layer_norm(s1, _w(so.LayerNorm), _b(so.LayerNorm), so.LayerNorm.eps, r_h1)
                r_a, r_in = rel_add(a, h_in, r_s1)
                r_heads = rel_linear(heads.reshape(n, -1), _w(so.dense), _b(so.dense), r_a).view(heads.shape)
                results.setdefault(("enc_self", li), []).append(r_heads.sum(dim=(0, 2)))
                r_v = rel_attention_values(probs, v, sa.num_attention_heads, r_heads)
                r_h = r_in + rel_linear(h_in, _w(sa.value), _b(sa.value), r_v)
        return {k: torch.stack(v) for k, v in results.items()}, torch.tensor(target_logits), tokens


class GPT2:
    """GPT-2: pre-norm decoder, fused Conv1D q/k/v (weight [in, out]), tied LM head."""

    def __init__(self, model):
        self.m = model

    @staticmethod
    def _conv(x, conv):  # Conv1D: y = x W + b, W [in, out]
        return linear(x, conv.weight.detach().double().T, conv.bias.detach().double())

    @staticmethod
    def _rel_conv(x, conv, r_y):
        return rel_linear(x, conv.weight.detach().double().T, conv.bias.detach().double(), r_y)

    def relevance(self, ids):
        tr = self.m.transformer
        ids = list(ids)
        n = len(ids)
        d = self.m.config.n_embd
        h = tr.wte.weight.detach().double()[ids] + tr.wpe.weight.detach().double()[torch.arange(n)]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        cache = []
        for block in tr.h:
            x1 = layer_norm(h, _w(block.ln_1), _b(block.ln_1), block.ln_1.eps)
            qkv = self._conv(x1, block.attn.c_attn)
            q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
            n_heads = block.attn.num_heads
            heads, probs = attention(q, k, v, n_heads, (d // n_heads) ** -0.5, causal)
            a = self._conv(heads.reshape(n, -1), block.attn.c_proj)
            h1 = h + a
            x2 = layer_norm(h1, _w(block.ln_2), _b(block.ln_2), block.ln_2.eps)
            f1 = self._conv(x2, block.mlp.c_fc)
            g = block.mlp.act(f1)
            f2 = self._conv(g, block.mlp.c_proj)
            cache.append((h, x1, heads, probs, v, a, h1, x2, g, f2, block))
            h = h1 + f2
        z = layer_norm(h, _w(tr.ln_f), _b(tr.ln_f), tr.ln_f.eps)
        out_w = self.m.lm_head.weight.detach().double()
        logits = z @ out_w.T
        tokens = logits.argmax(-1)
        results, target_logits = {}, []
        for t in range(n):
            k = int(tokens[t])
            target_logits.append(float(logits[t, k]))
            r_z = torch.zeros_like(z)
            r_z[t] = out_w[k] * z[t]
            r_h = rel_layer_norm(h, _w(tr.ln_f), _b(tr.ln_f), tr.ln_f.eps, r_z)
            for li in reversed(range(len(cache))):
                (h_in, x1, heads, probs, v, a, h1, x2, g, f2, block) = cache[li]
                r_h1, r_f2 = rel_add(h1, f2, r_h)
                r_g = self._rel_conv(g, block.mlp.c_proj, r_f2)
                r_x2 = self._rel_conv(x2, block.mlp.c_fc, r_g)
                r_h1 = r_h1 + rel_layer_norm(h1, _w(block.ln_2), _b(block.ln_2), block.ln_2.eps, r_x2)
                r_in, r_a = rel_add(h_in, a, r_h1)
                r_heads = self._rel_conv(heads.reshape(n, -1), block.attn.c_proj, r_a).view(heads.shape)
                results.setdefault(("dec_self", li), []).append(r_heads.sum(dim=(0, 2)))
                r_v = rel_attention_values(probs, v, block.attn.num_heads, r_heads)
                # only the value columns of c_attn receive relevance
                w = block.attn.c_attn.weight.detach().double()[:, 2 * d :].T
                b = block.attn.c_attn.bias.detach().double()[2 * d :]
                r_x1 = rel_linear(x1, w, b, r_v)
                r_h = r_in + rel_layer_norm(h_in, _w(block.ln_1), _b(block.ln_1), block.ln_1.eps, r_x1)
        return {k: torch.stack(v) for k, v in results.items()}, torch.tensor(target_logits), tokens


REFERENCES = {"marian": PostNormSeq2Seq, "bart": PostNormSeq2Seq, "bert": Bert, "gpt2": GPT2}


# -- the comparison ------------------------------------------------------------------------------
import pytest  # noqa: E402

from headlab.importance import ImportanceData, describe_model, head_relevance, make_batches, translate_data  # noqa: E402
from support.models import tiny_model  # noqa: E402


def _data(info, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 4, 5][:n]
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in lengths])


@pytest.mark.parametrize("family", sorted(REFERENCES))
def test_fast_lrp_equals_neuron_by_neuron_reference(family):
    model = tiny_model(family, attn_implementation="eager").double()  # biases are non-zero
    info = describe_model(model)
    data = _data(info)
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=5)
    batch = next(make_batches(data, info, batch_size=len(data)))
    fast = head_relevance(model, batch)
    reference = REFERENCES[family](model)
    cache = {}
    for i, (row, position) in enumerate(fast.steps.tolist()):
        if row not in cache:
            src = batch.inputs["input_ids"][row][batch.inputs["attention_mask"][row].bool()].tolist()
            if info.is_seq2seq:
                n_dec = int(batch.steps[row].sum())
                cache[row] = reference.relevance(src, batch.inputs["decoder_input_ids"][row, :n_dec].tolist())
            else:
                cache[row] = reference.relevance(src)
        expected, logits, tokens = cache[row]
        assert int(fast.tokens[i]) == int(tokens[position])
        for key, values in fast.relevance.items():
            torch.testing.assert_close(values[i], expected[key][position], rtol=1e-7, atol=1e-9,
                                       msg=f"{family} {key} target {(row, position)}")
    assert len(cache) == len(data)
