"""Two CPU processes (gloo) train for a few steps and end with identical weights.

The test launches this file with ``torchrun --nproc_per_node 2`` (on one machine, ``accelerate
launch`` starts several CPU processes only through mpirun; torchrun sets the same environment
that ``Accelerator`` reads). Run as a script, it trains a tiny model and writes each rank's
weights and batch sizes.
"""

import os
import subprocess
import sys
from pathlib import Path


def _worker(out_dir: str) -> None:
    import json

    import torch
    from accelerate import Accelerator
    from safetensors.torch import save_file

    from headlab.nmt.train import train
    from headlab.shard import before_joining
    from headlab.training.config import TrainConfig
    from support.nmt import tiny_corpus, tiny_marian, tiny_tokenizer
    torch.set_num_threads(1)
    before_joining()  # as headlab.shard.new_accelerator does
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    corpus = tiny_corpus(200)
    tokenizer = tiny_tokenizer(corpus, vocab_size=300)
    # A different seed per rank: DDP must broadcast rank 0's weights at the start.
    model = tiny_marian(tokenizer, seed=rank)
    seen = []

    def record(model, batch, step):
        seen.append(batch["input_ids"].shape[0])
        return torch.zeros(())

    config = TrainConfig(out_dir=os.path.join(out_dir, "run"), max_tokens=300, lr=3e-3, warmup_steps=2,
                         max_steps=4, validate=False, progress=False, seed=5, save_every_steps=2)
    result = train(model, tokenizer, corpus, None, config, accelerator=accelerator, extra_loss=record)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out_dir, f"rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"world": accelerator.num_processes, "step": result.step, "batch_sizes": seen}, handle)


def test_two_cpu_processes_end_with_identical_weights(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", __file__, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(info["world"] == 2 and info["step"] == 4 for info in infos)
    assert infos[0]["batch_sizes"] != infos[1]["batch_sizes"]  # different shards of the data
    rank0, rank1 = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    assert (tmp_path / "run" / "last" / "rng-1.safetensors").is_file()
    assert not list((tmp_path / "run" / "last").glob("*.pt"))  # no pickle (tests/test_training_state_files.py)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    _worker(sys.argv[1])
