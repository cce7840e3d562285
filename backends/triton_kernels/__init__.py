"""Triton kernels of rocdraft: paged KV write, unified paged attention, fused draft-step update.

Every kernel file holds the ``@triton.jit`` kernel and its checked wrapper; the torch reference
it must equal lives next to the code that owns the semantics (``backends/kv_cache.py``,
``backends/torch_sdpa.py``, ``drafter/index_math.py``). ``catalog.py`` lists every kernel for
``scripts/check_kernels_compile.py``.

Importing this package imports triton and decorates the kernels, which fixes whether they run
under the interpreter: set ``TRITON_INTERPRET=1`` (CPU) before importing it. Nothing outside
``rocdraft.backends.triton_attn`` and the scripts/tests imports it eagerly.
"""
