"""Chi-square goodness-of-fit helpers for checking that sampled tokens follow an exact distribution.

Used by the spec tests and by `tlt selfcheck` (which proves speculative sampling lossless on a user's model). Pure
torch (the chi-square survival function is the regularised upper incomplete gamma, `torch.special.gammaincc`), so the
selfcheck needs no scipy.

    counts = torch.bincount(samples, minlength=V)
    pvalue = chi_square_pvalue(counts, expected_probs)        # small p-value = samples do not follow the probs

Bins whose expected count is below `min_expected` are pooled into one bin (the usual validity rule for the
chi-square approximation); a bin with expected probability 0 but observed samples makes the p-value 0 (an
impossible token was drawn).
"""

from __future__ import annotations

import torch


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square with `dof` degrees of freedom."""
    if dof <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


def chi_square_pvalue(
    observed: torch.Tensor,  # [K] counts (any integer or float dtype)
    expected_probs: torch.Tensor,  # [K] probabilities (normalised here)
    min_expected: float = 5.0,  # pool bins expected to hold fewer samples than this
) -> float:
    """Pearson chi-square goodness-of-fit p-value of `observed` against `expected_probs`."""
    obs = observed.double().flatten().cpu()
    probs = expected_probs.double().flatten().cpu()
    if obs.shape != probs.shape:
        raise ValueError(f"observed {tuple(obs.shape)} vs expected {tuple(probs.shape)}")
    total = float(obs.sum())
    if total <= 0:
        raise ValueError("no samples")
    probs = probs / probs.sum()
    if bool(((probs <= 0) & (obs > 0)).any()):
        return 0.0
    exp = probs * total
    small = exp < min_expected
    obs_b = torch.cat([obs[~small], obs[small].sum().view(1)])
    exp_b = torch.cat([exp[~small], exp[small].sum().view(1)])
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    return chi2_sf(stat, int(obs_b.numel()) - 1)


def joint_pair_pvalue(
    first: torch.Tensor,  # [S] int64 first sampled token
    second: torch.Tensor,  # [S] int64 second sampled token
    p_first: torch.Tensor,  # [V] exact distribution of the first token
    p_second_given_first: torch.Tensor,  # [V, V] exact distribution of the second token given the first (rows)
    min_expected: float = 5.0,
) -> float:
    """Goodness of fit of the pairs (first, second) against p(first) * p(second | first), over V*V bins: tests the
    first token's marginal and the second token's conditional law at once."""
    v = p_first.shape[0]
    counts = torch.bincount((first * v + second).cpu(), minlength=v * v)
    joint = (p_first.double().cpu().unsqueeze(1) * p_second_given_first.double().cpu()).flatten()
    return chi_square_pvalue(counts, joint, min_expected)
