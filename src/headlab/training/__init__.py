"""The training engine below the features: one loop for every trainer of headlab.

* :mod:`headlab.training.loop` - :func:`~headlab.training.loop.train` (Accelerate, token-budget
  batches, atomic checkpoints, resume, time limit, early stopping) and the checkpoint helpers;
* :mod:`headlab.training.state_files` - the resume point's optimizer and RNG states, safetensors
  with a JSON header (no pickle);
* :mod:`headlab.training.losses` - the losses it minimises (seq2seq, causal LM, masked LM);
* :mod:`headlab.training.corpus` - sequence pairs as token ids and their padded batches.

``headlab nmt train``, ``headlab lm train`` and ``headlab prune train`` supply what is theirs
(data, model, validation) through the loop's hooks. Its options are
:class:`headlab.training.config.TrainConfig` (plain values).
"""
