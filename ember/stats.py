"""Small-sample statistics for `ember sweep`: mean and t confidence interval, Welch's t-test,
an exact permutation test.

    summarize([1.0, 2.0, 3.0])          # n, mean, std, 95% CI of the mean
    welch([2.1, 2.2, 2.0], [2.4, 2.5, 2.3])
    permutation_test([2.1, 2.2, 2.0], [2.4, 2.5, 2.3])

DESIGN.md places the statistics in ``sweep.py``; they are a module of their own so that the
formulas can be read and tested (against scipy) apart from the orchestration.

Seeds are expensive, so a sweep has 3-10 values per setting; these are the tests that are
honest at that size:

- the CI of a mean is ``mean ± t_{0.975, n-1} · s / √n`` (Student t, sample std ``s``);
- Welch's t-test does not assume equal variances: ``t = (m_a - m_b) / √(s_a²/n_a + s_b²/n_b)``
  with the Welch–Satterthwaite degrees of freedom
  ``ν = (v_a + v_b)² / (v_a²/(n_a-1) + v_b²/(n_b-1))``, ``v = s²/n``;
- the permutation test needs no normality: under "no difference" every split of the pooled
  values into groups of n_a and n_b is equally likely, so the two-sided p is the share of
  splits whose |difference of means| is at least the observed one. All C(n_a+n_b, n_a)
  splits are enumerated up to 20 000; beyond that a seeded Monte Carlo of 20 000 draws gives
  p = (hits + 1) / (draws + 1). Its smallest attainable p is reported too: with 3 vs 3 seeds it
  is 2/20 = 0.1, so no 3-seed comparison can be significant at 0.05 by this test.

scipy is not a dependency, so the Student t distribution is computed here: its tail is a
regularized incomplete beta function, ``P(|T| > t) = I_x(ν/2, 1/2)`` with ``x = ν/(ν+t²)``,
evaluated by its continued fraction (modified Lentz algorithm; Numerical Recipes §6.4 and
Abramowitz & Stegun 26.5.8), and the quantile by bisection on the tail. Tests compare all of
it with scipy to ~1e-10.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

CONFIDENCE = 0.95
MAX_EXACT = 20_000  # enumerate every relabeling up to this many
RESAMPLES = 20_000  # else this many seeded random relabelings


# ---------------------------------------------------------------- the t distribution


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction 1/(1+ d1/(1+ d2/(1+ ...))) of I_x(a, b), by modified Lentz."""
    tiny = 1e-300
    f, c, d = tiny, tiny, 0.0
    for k in range(9_999):  # the coefficient d_k; the first term's numerator is 1
        if k == 0:
            num = 1.0
        elif k % 2:  # d_{2m+1}
            m = (k - 1) // 2
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:  # d_{2m}
            m = k // 2
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(c * d - 1.0) < 1e-16:
            return f
    raise ArithmeticError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float, y: float | None = None) -> float:
    """Regularized incomplete beta I_x(a, b); pass ``y = 1 - x`` when it is known more exactly."""
    y = 1.0 - x if y is None else y
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_front = a * math.log(x) + b * math.log(y) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, y) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` (real, > 0) degrees of freedom."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    t2 = t * t
    half_two_sided = 0.5 * betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))
    return half_two_sided if t >= 0 else 1.0 - half_two_sided


def t_cdf(t: float, df: float) -> float:
    """P(T <= t)."""
    return t_sf(-t, df)


def t_ppf(p: float, df: float) -> float:
    """The quantile: the t with P(T <= t) = p, by bisection on the upper tail."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_ppf needs 0 < p < 1, got {p}")
    if p == 0.5:
        return 0.0
    q = 1.0 - p if p > 0.5 else p  # solve t_sf(t) = q for t > 0; symmetry gives the sign
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > q:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_sf(mid, df) > q else (lo, mid)
        if hi - lo <= 4e-16 * hi:
            break
    t = 0.5 * (lo + hi)
    return t if p > 0.5 else -t


# ---------------------------------------------------------------- one sample


def _mean_var(values: list[float]) -> tuple[float, float]:
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else math.nan
    return mean, var


def summarize(values: list[float], confidence: float = CONFIDENCE) -> dict:
    """n, mean, sample std and the Student-t CI of the mean (None where n is too small)."""
    n = len(values)
    if n < 2:
        mean = _mean_var(values)[0] if n else None
        return {"n": n, "mean": mean, "std": None, "ci_low": None, "ci_high": None}
    mean, var = _mean_var(values)
    std = math.sqrt(var)
    half = t_ppf(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half}


# ---------------------------------------------------------------- two samples


def welch(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> dict:
    """Welch's t-test of mean(a) - mean(b): the difference, its CI, t, df and two-sided p.
    Every field but ``diff`` is None with fewer than 2 values a side or zero variance."""
    out = {"diff": None, "ci_low": None, "ci_high": None, "t": None, "df": None, "p": None}
    if not a or not b:
        return out
    (ma, va), (mb, vb) = _mean_var(a), _mean_var(b)
    out["diff"] = ma - mb
    if len(a) < 2 or len(b) < 2:
        return out
    sa, sb = va / len(a), vb / len(b)  # squared standard errors
    se = math.sqrt(sa + sb)
    if se == 0.0:
        return out
    df = (sa + sb) ** 2 / (sa**2 / (len(a) - 1) + sb**2 / (len(b) - 1))  # Welch–Satterthwaite
    t = (ma - mb) / se
    half = t_ppf(0.5 + confidence / 2, df) * se
    p = 2.0 * t_sf(abs(t), df)  # P(|T| >= |t|)
    out.update(ci_low=ma - mb - half, ci_high=ma - mb + half, t=t, df=df, p=p)
    return out


def permutation_test(
    a: list[float], b: list[float], resamples: int = RESAMPLES, max_exact: int = MAX_EXACT, seed: int = 0
) -> dict:
    """Two-sided permutation test on the difference of means: p, whether it was exact, the
    number of relabelings used, and the smallest p this design can give."""
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        return {"p": None, "exact": None, "relabelings": 0, "p_min": None}
    pooled = np.asarray([*a, *b], dtype=np.float64)
    total = math.fsum(pooled)
    tol = 1e-12 * max(1.0, float(np.abs(pooled).max()))  # equal in exact arithmetic counts as a tie

    def diff(sum_a: float) -> float:
        return sum_a / na - (total - sum_a) / nb

    observed = abs(diff(math.fsum(pooled[:na])))
    count = math.comb(na + nb, na)
    if count <= max_exact:
        diffs = np.array(
            [abs(diff(math.fsum(pooled[list(idx)]))) for idx in itertools.combinations(range(na + nb), na)]
        )
        p = float(np.mean(diffs >= observed - tol))
        p_min = float(np.mean(diffs >= diffs.max() - tol))
        return {"p": p, "exact": True, "relabelings": count, "p_min": p_min}
    rng = np.random.default_rng(seed)
    shuffled = rng.permuted(np.broadcast_to(pooled, (resamples, na + nb)), axis=1)
    sums = shuffled[:, :na].sum(axis=1)
    hits = int(np.sum(np.abs(diff(sums)) >= observed - tol))
    return {
        "p": (hits + 1) / (resamples + 1),
        "exact": False,
        "relabelings": resamples,
        "p_min": 1 / (resamples + 1),
    }


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound near 0 and 1, unlike p ± z·se)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
