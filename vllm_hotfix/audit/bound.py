"""What a sample says about the whole dataset: the exact binomial (Clopper-Pearson) upper bound on
the fraction of wrong files, without scipy (the package's only dependency is wrapt).

With k wrong files of n judged, chosen at random, the bound at confidence 1 - a is the largest
fraction p for which seeing k or fewer wrong has probability a or more: P(X <= k; n, p) = a, the
(1 - a) quantile of Beta(k + 1, n - k). For k = 0 that is 1 - a^(1/n) (n = 300: 0.99% at 95%);
otherwise it is found by bisection on the binomial distribution function, summed in logarithms so
that n in the millions neither overflows nor underflows. Files are sampled without replacement,
for which the binomial bound is conservative.
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    terms = [
        base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def upper_bound(wrong: int, judged: int, confidence: float = CONFIDENCE) -> float:
    """The largest wrong fraction that `wrong` of `judged` sampled files allows at `confidence`."""
    if not 0 <= wrong <= judged or judged < 1 or not 0.0 < confidence < 1.0:
        raise ValueError(f"no bound for {wrong} wrong of {judged} at confidence {confidence}")
    alpha = 1.0 - confidence
    if wrong == judged:
        return 1.0
    if wrong == 0:
        return 1.0 - float(alpha ** (1.0 / judged))
    low, high = 0.0, 1.0  # the CDF falls as p rises
    for _ in range(200):
        middle = (low + high) / 2
        if binomial_cdf(wrong, judged, middle) > alpha:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return high
