"""Summaries of repeated runs (issue 14): the mean of a cell's runs and its 95% confidence
interval from Student's t distribution, which is what a handful of seeds calls for (with 3 runs
the normal approximation's 1.96 would understate the interval by more than half).

    lo, hi = ci95([0.81, 0.80, 0.83])
"""

import math

# Two-sided 95% critical values of Student's t, t_{0.975, df}, for df = 1..30 (standard tables,
# e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2); above 30, the Cornish-Fisher
# expansion of t's quantile around the normal one (Abramowitz and Stegun 26.7.5), accurate to
# about 1e-6 there.
_T975 = [12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272]
_Z975 = 1.959964


def t975(df):
    """t_{0.975, df} for df >= 1."""
    if df < 1:
        raise ValueError("degrees of freedom must be >= 1, got %r" % df)
    if df <= len(_T975):
        return _T975[int(df) - 1]
    z = _Z975
    return (z + (z ** 3 + z) / (4 * df)
            + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def mean(values):
    if not values:
        raise ValueError("the mean of no values")
    return sum(values) / len(values)


def stdev(values):
    """The sample standard deviation (n - 1 in the denominator); needs 2 values or more."""
    if len(values) < 2:
        raise ValueError("a standard deviation needs 2 values or more, got %d" % len(values))
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def ci95(values):
    """(low, high): the 95% confidence interval of the mean of `values` (t-based). With one
    value, (value, value) is no interval at all: callers report n alongside."""
    m = mean(values)
    if len(values) < 2:
        return m, m
    half = t975(len(values) - 1) * stdev(values) / math.sqrt(len(values))
    return m - half, m + half
