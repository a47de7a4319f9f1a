"""The chi-square check of the distribution tests (test_spec_acceptance_lossless, test_spec_coupling)."""

import numpy as np


def chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, alpha = 1e-3 critical value), bins with expected count < 5 merged into one; the critical
    value by the Wilson-Hilferty approximation (fixed seeds make the outcome deterministic)."""
    expected = probs * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.0902  # one-sided normal quantile for alpha = 1e-3
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat, crit
