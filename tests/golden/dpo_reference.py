"""Produce tests/golden/dpo_losses.json: DPO / robust DPO / IPO losses for fixed
log-probabilities, computed by hand with Python's math module (independent of torch).

DPO (Rafailov et al., 2023, eq. 7):  -log σ(β·h)
robust DPO (Chowdhury et al., 2024): -(1-ε)·log σ(β·h) - ε·log σ(-β·h)
IPO (Azar et al., 2023, eq. 17):     (h - 1/(2β))²
with h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l)).

Run: .venv/bin/python -m tests.golden.dpo_reference
"""

from __future__ import annotations

import json
import math
from pathlib import Path

OUT = Path(__file__).parent / "dpo_losses.json"

# (policy_chosen, policy_rejected, reference_chosen, reference_rejected)
LOGPS = [
    (-12.5, -14.0, -13.0, -13.5),
    (-40.25, -38.0, -41.0, -37.5),
    (-3.0, -9.75, -3.5, -9.0),
    (-101.0, -99.5, -100.0, -100.0),
]
CASES = [
    {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0},
    {"loss_type": "sigmoid", "beta": 0.5, "label_smoothing": 0.2},
    {"loss_type": "ipo", "beta": 0.1, "label_smoothing": 0.0},
]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def expected(case: dict) -> list[dict]:
    beta, eps = case["beta"], case["label_smoothing"]
    rows = []
    for pc, pr, rc, rr in LOGPS:
        h = (pc - rc) - (pr - rr)
        if case["loss_type"] == "sigmoid":
            loss = -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
        else:
            loss = (h - 1 / (2 * beta)) ** 2
        rows.append(
            {"loss": loss, "reward_chosen": beta * (pc - rc), "reward_rejected": beta * (pr - rr)}
        )
    return rows


if __name__ == "__main__":
    data = {"logps": LOGPS, "cases": [{**case, "expected": expected(case)} for case in CASES]}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")
