"""Numerical comparisons shared by the tests."""
import torch


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative error ||got - want|| / ||want|| (2-norms over all elements, in float64)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
