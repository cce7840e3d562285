"""rocdraft: AMD/ROCm-first speculative decoding with an EAGLE drafter."""
