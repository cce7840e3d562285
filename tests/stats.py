"""Test utility: goodness of fit of sampled token counts against exact probabilities."""
from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_prob: float = 0.0
                       ) -> float:
    """Pearson chi-square goodness of fit over the categories with probability > ``min_prob``
    (counts and probs of the same shape) -> the p-value (1.0 with a single category)."""
    support = probs > min_prob
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         stat.double() / 2))
