"""Tensor parallelism over ``torch.distributed`` (issue 15).

One concept per file:

- ``group``: the process group of one rank (``ParallelGroup``), its rendezvous, a free port;
- ``validation``: which tensor-parallel sizes a model allows and how its heads split
  (``check_tensor_parallel`` -> ``TensorParallelLayout``);
- ``layers``: the parallel layers (row-parallel linear, vocabulary-parallel embedding and
  lm_head) and the byte counter of their collectives (``CommCounter``);
- ``shard_loader``: each rank reads only its slices of a safetensors checkpoint;
- ``tp_model``: the sharded Llama-family target of one rank.

Nothing here holds module-level state: the group and the counter are passed explicitly.
"""
