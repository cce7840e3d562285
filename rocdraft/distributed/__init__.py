"""Tensor parallelism over ``torch.distributed`` (issue 15).

One concept per file:

- ``group``: the process group of one rank (``ParallelGroup``), its rendezvous, a free port;
- ``validation``: which tensor-parallel sizes a model allows and how its heads split
  (``check_tensor_parallel`` -> ``TensorParallelLayout``);
- ``layers``: the parallel layers (row-parallel linear, vocabulary-parallel embedding and
  lm_head) and the byte counter of their collectives (``CommCounter``);
- ``shard_loader``: each rank reads only its slices of a safetensors checkpoint;
- ``tp_model``: the sharded Llama-family target of one rank;
- ``messages``: the compact int64 tensor message rank 0 broadcasts before each module call
  that holds collectives (no pickled objects per step);
- ``proxy``: rank 0's stand-in for the target that sends those messages;
- ``head_tables``: whole copies of the target's vocabulary tables, so the EAGLE head runs on
  rank 0 alone and its draft loop holds no collective (and is graph-captured);
- ``worker``: the loop of ranks 1..N-1 (receive, run the same call on their shards);
- ``executor``: starting (spawn or torchrun), calling, failure handling and shutdown of the
  workers;
- ``engine_setup``: the two engine-facing steps (refuse before loading, the worker spec).

Nothing here holds module-level state: the group and the counter are passed explicitly.
"""
