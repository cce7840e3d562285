"""HIP kernels (csrc/), their JIT build (build.py), torch ops (ops.py) and the API the drafter
and backends call (dispatch.py). Importing this package builds and loads nothing."""
