"""Gate trajectories of a physically pruned model name each head by its real layer and original
index, the numbering of gates.json (they were listed by position: the wrong layer and head)."""

import json
import math

import matplotlib

matplotlib.use("Agg")

from headlab import prune_heads  # noqa: E402
from headlab.pipeline.figures import plot_gate_trajectories  # noqa: E402
from headlab.pruning.train import PruneConfig, encode_monolingual_corpus, prune_train, read_trajectory  # noqa: E402
from headlab.training.config import TrainConfig  # noqa: E402


def _gpt2(tokenizer):
    import transformers as tf

    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))


def _gate(model, tokenizer, corpus, out_dir):
    train = TrainConfig(out_dir=str(out_dir), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant",
                        max_steps=2, validate=False, keep_epoch_checkpoints=False, progress=False, seed=3)
    config = PruneConfig(gates="dec_self", lam=0.0, log_every=1, eval_beam=1, gate_lr=0.1, train=train)
    prune_train(model, tokenizer, encode_monolingual_corpus(tokenizer, corpus.targets[:16], 64), None, config)
    return read_trajectory(out_dir)


def _named(values) -> set[str]:
    return {f"dec_self:{layer}:{head}" for layer, row in enumerate(values) for head, v in enumerate(row)
            if v is not None and not (isinstance(v, float) and math.isnan(v))}


def test_pruned_model_trajectory_names_heads_as_gates_json(corpus, tokenizer, tmp_path):
    model = _gpt2(tokenizer)
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 2, 3]})  # layer 1 keeps head 1
    records = _gate(model, tokenizer, corpus, tmp_path / "r")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert _named(record["p_open"]["dec_self"]) == {"dec_self:1:1"}
    gates = json.loads((tmp_path / "r" / "gates.json").read_text())
    assert _named(gates["scores"]["dec_self"]) == {"dec_self:1:1"}
    _, data = plot_gate_trajectories({"run": records})
    assert set(data["run"]["p_open"]) == {"dec_self:1:1"}
    assert data["run"]["p_open"]["dec_self:1:1"] == [r["p_open"]["dec_self"][1][1] for r in records]


def test_unpruned_model_trajectory_keeps_its_layout(corpus, tokenizer, tmp_path):
    records = _gate(_gpt2(tokenizer), tokenizer, corpus, tmp_path / "r")
    rows = records[0]["p_open"]["dec_self"]
    assert len(rows) == 2 and all(len(row) == 4 and None not in row for row in rows)
    gates = json.loads((tmp_path / "r" / "gates.json").read_text())
    assert _named(rows) == _named(gates["scores"]["dec_self"])
