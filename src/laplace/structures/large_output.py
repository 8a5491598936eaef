"""Many outputs (LLM vocabularies): where no C × C matrix is formed, and what is refused.

Above ``LARGE_OUTPUT_THRESHOLD`` outputs, output curvatures are diagonal plus low rank and the
last layer's GLM predictive gives output variances (B, C) only. ``docs/large_outputs.md``
describes the maths and the error bounds.
"""

from __future__ import annotations

__all__ = [
    "LARGE_OUTPUT_THRESHOLD",
    "OUTPUT_FACTOR_RANK",
    "check_glm",
    "is_large_output",
    "variances_only_reason",
]

#: Number of outputs C above which last-layer curvatures are kept diagonal plus low rank and the
#: GLM predictive computes only output variances (a dense C × C float32 matrix is 16 MiB here,
#: a batch of 100 points' (C, C) output Hessians 1.6 GiB).
LARGE_OUTPUT_THRESHOLD = 2048

#: Default largest rank of the low-rank term of a Kronecker output factor above the threshold.
OUTPUT_FACTOR_RANK = 32


def is_large_output(n_outputs: int) -> bool:
    """Whether ``n_outputs`` exceeds ``LARGE_OUTPUT_THRESHOLD``."""
    return n_outputs > LARGE_OUTPUT_THRESHOLD


def variances_only_reason(n_outputs: int) -> str | None:
    """Why a last layer's GLM predictive gives only output variances; None at or below."""
    if not is_large_output(n_outputs):
        return None
    return (
        f"the model has C={n_outputs} outputs, more than LARGE_OUTPUT_THRESHOLD="
        f"{LARGE_OUTPUT_THRESHOLD}, so the last-layer GLM predictive computes only output "
        "variances (B, C), no (B, C, C) covariance"
    )


def check_glm(n_outputs: int) -> None:
    """Refuse a GLM predictive without a last layer's closed form above the threshold.

    Above it the predictive would need C Jacobian rows per point (C backward passes) and a
    (B, C, C) covariance; only the last layer's closed forms give output variances.

    Raises:
        ValueError: For more than ``LARGE_OUTPUT_THRESHOLD`` outputs, naming the ways out.
    """
    if is_large_output(n_outputs):
        raise ValueError(
            f"the model has C={n_outputs} outputs, more than LARGE_OUTPUT_THRESHOLD="
            f"{LARGE_OUTPUT_THRESHOLD}: the GLM predictive over these weights needs C Jacobian "
            "rows per point (C backward passes) and a (B, C, C) covariance. Use pred_type='nn' "
            "(link_approx='mc'; one forward pass per weight sample) or subset_of_weights="
            "'last_layer' (output variances in closed form)."
        )
