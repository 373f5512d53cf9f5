"""Adaptive speculation length: pick k in the profile's range to maximise expected tokens per second.

Expected tokens of one iteration with per-token acceptance a and depth k (chain):
    tau(k) = (1 - a^(k+1)) / (1 - a);  with c candidates the first level accepts with 1 - (1 - a)^c.
Its cost is measured, not assumed: draft call time as a function of k and target pass time as a function
of the number of scored tokens, both learnt online from the calls this instance makes (a prior in units of
one target step serves until there are measurements).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EWMA_WEIGHT = 0.1
# Priors (units: one single-token target step) until measurements exist: a forward's fixed cost plus a small
# per-token cost, the shape measured for small models on CPUs (docs/SPECULATION.md).
PRIOR_DRAFT_FIXED, PRIOR_DRAFT_PER_TOKEN = 0.05, 0.12
PRIOR_TARGET_FIXED, PRIOR_TARGET_PER_TOKEN = 1.0, 0.04


@dataclass
class LinearCost:
    """Online fit of seconds = fixed + per_unit * units from EWMA means per observed `units`."""

    prior_fixed: float
    prior_per_unit: float
    means: dict[int, float] = field(default_factory=dict)

    def observe(self, units: int, seconds: float) -> None:
        old = self.means.get(units)
        self.means[units] = seconds if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * seconds

    def predict(self, units: int, unit_scale: float) -> float:
        """Predicted seconds; `unit_scale` converts the prior (in target steps) to seconds."""
        if units in self.means:
            return self.means[units]
        if len(self.means) >= 2:
            xs = list(self.means)
            ys = [self.means[x] for x in xs]
            mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mean_x) ** 2 for x in xs)
            slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var, 0.0)
            return max(mean_y + slope * (units - mean_x), 1e-6)
        if len(self.means) == 1:
            (x, y), = self.means.items()
            return max(y + self.prior_per_unit * unit_scale * (units - x), 1e-6)
        return (self.prior_fixed + self.prior_per_unit * units) * unit_scale


@dataclass
class CostModel:
    """Measured call costs of one speculative_decoding instance (shared by its requests)."""

    draft: LinearCost = field(default_factory=lambda: LinearCost(PRIOR_DRAFT_FIXED, PRIOR_DRAFT_PER_TOKEN))
    target: LinearCost = field(default_factory=lambda: LinearCost(PRIOR_TARGET_FIXED, PRIOR_TARGET_PER_TOKEN))

    @property
    def target_step_s(self) -> float:
        return self.target.means.get(1, 1.0)

    def iteration_cost(self, k: int, candidates: int, drafted: bool = True) -> float:
        """Predicted seconds of proposing k tokens (a model drafter's call unless not `drafted`: prompt lookup)
        and verifying them."""
        scale = self.target_step_s
        draft = self.draft.predict(k, scale) if drafted else 0.0
        return draft + self.target.predict(1 + candidates * k, scale)


def expected_tokens(acceptance: float, k: int, candidates: int = 1) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    first = 1 - (1 - a) ** candidates
    # 1 bonus token + first level + the rest of the chain behind it.
    return 1 + first * (1 - a**k) / (1 - a)


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance of one sequence: a geometric process, so accepted tokens are successes and a
    pass that stopped early is one failure. Decayed counts follow the text as it changes."""

    successes: float = 2.0
    failures: float = 1.0  # prior: a = 2/3
    decay: float = 0.8

    def observe(self, accepted: int, proposed_depth: int) -> None:
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1 if accepted < proposed_depth else 0)

    @property
    def rate(self) -> float:
        return self.successes / (self.successes + self.failures)


def choose_lookup_length(acceptance: float, longest: int, costs: CostModel) -> int:
    """How many tokens prompt lookup proposes (1 .. `longest`): as `choose_length`, a lookup costing no draft
    call. Each row it adds costs a little target time, so a sequence whose lookups are seldom right proposes
    short ones and one that copies long spans proposes long ones."""
    return choose_length(acceptance, 1, longest, 1, costs, drafted=False) if longest >= 1 else 0


def choose_length(acceptance: float, lo: int, hi: int, candidates: int, costs: CostModel,
                  drafted: bool = True) -> int:
    """The k in [lo, hi] with the most expected tokens per second."""
    return max(range(lo, hi + 1), key=lambda k: expected_tokens(acceptance, k, candidates)
               / costs.iteration_cost(k, candidates, drafted))
