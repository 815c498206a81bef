"""The stopping rule of a multi-round fit: a plateau of validation accuracy.

After every round the engine scores the global model on the validation split (`val_fraction`,
best as the clients' own hold-outs: `data.val_split: clients`); once `patience` rounds have
passed without it rising by at least `min_delta` above its best, the fit stops there: the final
broadcast goes out as after the last round, and `num_rounds` is only the budget. The test split
is never looked at.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stopping:
    """patience: rounds without a gain of more than `min_delta` in validation accuracy over its
    best before the fit stops; 0 runs every round of `num_rounds`. min_delta: 0.001 = 0.1 point."""

    patience: int = 0
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.patience, int) and self.patience >= 0):
            raise ValueError(f"stopping.patience must be an integer ≥ 0 (0: no early stop), got {self.patience!r}")
        if not self.min_delta >= 0:
            raise ValueError(f"stopping.min_delta must be ≥ 0, got {self.min_delta!r}")

    @property
    def active(self) -> bool:
        return self.patience > 0

    def stops(self, state: dict[str, Any], round_index: int, accuracy: float) -> bool:
        """Records round `round_index`'s validation accuracy in `state` (the fit's running totals,
        kept in checkpoints: a resumed fit goes on counting) and says whether to stop after it."""
        if "stop_best_round" not in state or accuracy - self.min_delta > state["stop_best"]:  # Lightning's rule
            state["stop_best"], state["stop_best_round"] = accuracy, round_index
        return round_index - state["stop_best_round"] >= self.patience
