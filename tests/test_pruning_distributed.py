"""Gated fine-tuning in two CPU processes (gloo, torchrun): the gates stay identical across
ranks (DDP averages their gradients) and rank 0 exports the pruned model.

Launched as in tests/test_nmt_distributed.py; run as a script, it is one rank's worker.
"""

import os
import subprocess
import sys
from pathlib import Path


def _worker(out_dir: str) -> None:
    import json

    import torch
    from accelerate import Accelerator

    from headlab.pruning.train import PruneConfig, prune_train
    from headlab.shard import before_joining
    from headlab.training.config import TrainConfig
    from support.nmt import tiny_corpus, tiny_marian, tiny_tokenizer
    torch.set_num_threads(1)
    before_joining()  # as headlab.shard.new_accelerator does
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    corpus = tiny_corpus(200)
    tokenizer = tiny_tokenizer(corpus, vocab_size=300)
    model = tiny_marian(tokenizer)

    config = PruneConfig(gates="all", lam=0.5, gate_lr=0.1, log_every=2, train=TrainConfig(
        out_dir=os.path.join(out_dir, "run"), max_tokens=300, lr=1e-3, warmup_steps=0, schedule="constant",
        max_steps=6, max_epochs=10, validate=False, keep_epoch_checkpoints=False, progress=False, seed=5))
    # Keep each rank's gate module to compare log_alpha after training.
    import headlab.pruning.train as pruning_train

    made = []
    real_for_model = pruning_train.HardConcreteGates.for_model

    def remember(model, *args, **kwargs):
        made.append(real_for_model(model, *args, **kwargs))
        return made[-1]

    pruning_train.HardConcreteGates.for_model = remember
    result = prune_train(model, tokenizer, corpus, None, config, accelerator=accelerator, log=lambda m: None)
    gates_seen = {k: v.tolist() for k, v in made[0].log_alpha.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"world": accelerator.num_processes, "step": result.step, "stopped": result.stopped,
                   "log_alpha": gates_seen}, handle)


def test_two_cpu_processes_keep_identical_gates(tmp_path):
    import json

    from safetensors.torch import load_file

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", __file__, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(info["world"] == 2 and info["step"] == 6 and info["stopped"] == "max_steps" for info in infos)
    assert infos[0]["log_alpha"] == infos[1]["log_alpha"]  # gradients averaged: the same gates
    assert infos[0]["log_alpha"]["enc_self_0"] != [3.0] * 4  # and they did train
    # The resume checkpoint holds the gates.
    state = load_file(str(tmp_path / "run" / "train" / "last" / "model.safetensors"))
    assert any(key.startswith("headlab_gates.log_alpha.") for key in state)
    assert (tmp_path / "run" / "pruned" / "headlab_pruning.json").is_file()
    assert (tmp_path / "run" / "result.json").is_file()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    _worker(sys.argv[1])
