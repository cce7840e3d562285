"""``rocdraft bench-serve`` as a script: ``python scripts/bench_serve.py --concurrency 8 --json``
takes the same flags (see ``rocdraft bench-serve --help`` and rocdraft/bench/serve_bench.py)."""
import sys

from rocdraft.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-serve", *sys.argv[1:]]))
