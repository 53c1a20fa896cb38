"""Evaluation: EleutherAI lm-eval in process on lmforge models, and perplexity.

`run_eval` runs lm-eval tasks (by name, or local YAMLs from include paths) on one or more
artifacts through the `LmforgeLM` adapter and writes a results JSON beside each;
`format_results_table` / `format_comparison_table` print them; `perplexity` scores held-out text
with a sliding window; `preference_accuracy` scores held-out preference pairs;
`write_demo_task` makes the demo's multiple-choice tasks for a data file.
Importing this package imports lm-eval (about a second).
"""

from lmforge.eval.harness import (
    EvalResult,
    LmforgeLM,
    format_comparison_table,
    format_results_table,
    run_eval,
)
from lmforge.eval.perplexity import perplexity
from lmforge.eval.preference import preference_accuracy
from lmforge.eval.tasks import DEMO_TASKS, write_demo_task

__all__ = [
    "DEMO_TASKS",
    "EvalResult",
    "LmforgeLM",
    "format_comparison_table",
    "format_results_table",
    "perplexity",
    "preference_accuracy",
    "run_eval",
    "write_demo_task",
]
