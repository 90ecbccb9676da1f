"""Step 2: the allocation frontier, a multiple-choice knapsack solved exactly as a Pareto set (size ascending, error
descending), so any size target reads off one point."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compress.base.errors import CompressError
from compress.search.sensitivity import Unit


@dataclass
class Allocation:
    schemes: list[str]  # per unit
    bits: int
    cost: float
    params: int

    @property
    def bits_per_weight(self) -> float:
        return self.bits / self.params

    def per_module(self, units: list[Unit]) -> dict[str, str]:
        return {name: scheme for unit, scheme in zip(units, self.schemes, strict=True) for name in unit.names}

    def counts(self) -> dict[str, int]:
        return {scheme: self.schemes.count(scheme) for scheme in sorted(set(self.schemes))}


class Frontier:
    """Every allocation no other beats on both size and predicted error, sizes ≤ ``max_bits``: the exact solution
    of the multiple-choice knapsack for every budget at once. Built unit by unit, keeping only the Pareto states
    (vectorised), with back-pointers to read any point's schemes."""

    def __init__(self, units: list[Unit], max_bits: float):
        self.units = units
        self.params = sum(unit.params for unit in units)
        bits, cost = np.zeros(1, dtype=np.int64), np.zeros(1)
        self._steps: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
        for unit in units:
            names = list(unit.bits)
            unit_bits = np.array([unit.bits[name] for name in names], dtype=np.int64)
            unit_cost = np.array([unit.cost[name] for name in names])
            all_bits = (bits[:, None] + unit_bits[None, :]).ravel()
            all_cost = (cost[:, None] + unit_cost[None, :]).ravel()
            parent = np.repeat(np.arange(len(bits)), len(names))
            choice = np.tile(np.arange(len(names)), len(bits))
            keep = all_bits <= max_bits
            all_bits, all_cost, parent, choice = all_bits[keep], all_cost[keep], parent[keep], choice[keep]
            order = np.lexsort((all_cost, all_bits))  # by bits, then cost
            all_bits, all_cost, parent, choice = all_bits[order], all_cost[order], parent[order], choice[order]
            best_before = np.concatenate([[np.inf], np.minimum.accumulate(all_cost)[:-1]])
            pareto = all_cost < best_before  # strictly better than every smaller-or-equal state
            bits, cost = all_bits[pareto], all_cost[pareto]
            self._steps.append((parent[pareto], choice[pareto], names))
        self.bits, self.cost = bits, cost

    def __len__(self) -> int:
        return len(self.bits)

    def bits_per_weight(self, index: int) -> float:
        return float(self.bits[index]) / self.params

    def allocation(self, index: int) -> Allocation:
        schemes: list[str] = []
        state = index
        for parent, choice, names in reversed(self._steps):
            schemes.append(names[choice[state]])
            state = parent[state]
        return Allocation(schemes[::-1], int(self.bits[index]), float(self.cost[index]), self.params)

    def at_most(self, bits_per_weight: float) -> int:
        """The least-error point within ``bits_per_weight`` (the smallest point when none fits)."""
        return max(int(np.searchsorted(self.bits, bits_per_weight * self.params, side="right")) - 1, 0)


def allocate(units: list[Unit], budget_bits: float) -> Allocation:
    """The scheme per unit with the least predicted error within ``budget_bits`` per weight."""
    frontier = Frontier(units, budget_bits * sum(unit.params for unit in units))
    if not len(frontier):
        raise CompressError(budget_error(units, budget_bits))
    return frontier.allocation(len(frontier) - 1)


def budget_error(units: list[Unit], budget_bits: float) -> str:
    smallest = sum(min(unit.bits.values()) for unit in units) / sum(unit.params for unit in units)
    return (
        f"search.budget_bits={budget_bits:g} is below the smallest allocation of these candidates "
        f"({smallest:.3f} bits/weight); raise search.budget_bits or add a smaller scheme to search.candidates"
    )
