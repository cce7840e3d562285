"""``torch.compile`` of the dense halves of every block (``LLM(compile=...)``, ``--compile``).

What is compiled: ``layers.qkv_rope`` (input norm, fused q/k/v matmul, RoPE) and
``layers.block_tail`` (o_proj, residual, post norm, fused gate/up, SiLU-mul, down, residual),
each once per process and shared by every layer of every model: their arguments are tensors,
tuples of tensors and ints, so the layers differ only in data and one graph serves them all
(nn.Module methods would guard on each layer object and recompile per layer). The attention
kernel, its KV writes and the per-step metadata stay eager between the two halves: their
index work is what the backends plan once per step.

Recompiles are bounded: ``dynamic=True`` makes the token count symbolic, so the graphs are
(n = 1, n >= 2) (torch specialises a size of 1) x the input widths qkv_rope sees (the
target's hidden size; EAGLE-3's 2H-wide midlayer input) for qkv_rope, and (n = 1, n >= 2) for
block_tail: at most 6 for a target and its head, whatever the batch sizes and lengths
(``tests/test_compiled_regions.py`` counts them over prefill, decode, verification and
drafting at batch sizes 1 to 3, then checks new shapes compile nothing). Two details keep it
so: each region runs under ``no_grad`` (dynamo guards on the grad mode, and the cost probes
and the steps differ there), and the tail gets a copy of the attention output (a view whose
base's strides differ between batch shapes: 8 graphs without the copy).

Backends: ``inductor`` (the default, what ``compile=True`` means; needs a C++ compiler on the
CPU, Triton on GPUs), ``aot_eager`` and ``eager`` (dynamo tracing only: for debugging, and what
CI uses to check the regions trace without a graph break).

Measured (built-in pair, CPU float32, 1 thread, inductor, torch 2.13): a block's dense
halves alone took 436 µs compiled against 346 eager at n = 1, 622 against 515 at n = 5, 1271
against 1113 at n = 40; ``LLM.generate`` with EAGLE-3 (2 prompts x 64 tokens) 303 tok/s
compiled against 397 eager (0.76x), after 25 s of compiling in the first generate. On this
CPU the halves are matmul-bound and inductor's generated wrappers cost more than the few
pointwise ops it fuses, hence off by default. On GPUs, where each half is several small
kernels, fusing RMSNorm, RoPE and SiLU-mul is where it can win; that has not been measured
(no GPU run), and compiled regions inside captured draft-loop graphs have not run on
hardware either.
Under tensor parallelism (o/down all-reduce inside the tail) compiling is refused.
"""
from __future__ import annotations

import functools

import torch

from rocdraft.errors import RocdraftError
from rocdraft.models.layers import BlockRegions, block_tail, qkv_rope

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def compile_backend(value: bool | str | None) -> str | None:
    """``LLM(compile=...)``: False / None -> None (eager), True -> "inductor", or a name from
    COMPILE_BACKENDS; anything else is a RocdraftError naming the value."""
    if value is None or value is False:
        return None
    if value is True:
        return "inductor"
    if isinstance(value, str) and value in COMPILE_BACKENDS:
        return value
    raise RocdraftError(f"compile must be True, False or one of {', '.join(COMPILE_BACKENDS)}, "
                        f"got {value!r}")


@functools.lru_cache(maxsize=None)
def compiled_regions(backend: str) -> BlockRegions:
    """The two regions compiled with ``backend`` (one pair per process and backend)."""
    if backend not in COMPILE_BACKENDS:
        raise RocdraftError(f"unknown compile backend {backend!r}; valid: "
                            f"{', '.join(COMPILE_BACKENDS)}")
    pre = torch.compile(qkv_rope, dynamic=True, backend=backend)
    tail = torch.compile(block_tail, dynamic=True, backend=backend)

    def compiled_qkv_rope(*args):
        with torch.no_grad():  # one grad mode: dynamo guards on it (cost probes vs steps)
            return pre(*args)

    def compiled_block_tail(residual, attn_out, *args):
        with torch.no_grad():
            # attn_out is a view of the backend's output, whose base strides differ between
            # batch shapes; dynamo guards on a view's base, so a copy (n x Hq x D, small
            # against the matmuls) keeps one graph.
            return tail(residual, attn_out.clone(), *args)

    return BlockRegions(compiled_qkv_rope, compiled_block_tail)
