"""Judging a model: retrieval accuracy, the seen / unseen-format retention suite, and ``headscope eval``.

* :mod:`~headscope.evaluation.accuracy`: retrieval accuracy (teacher-forced greedy exact match) with Wilson
  intervals, McNemar's paired test, held-out perplexity; the seen cells' prompts (:func:`eval_pairs`);
* :mod:`~headscope.evaluation.retention`: the suite's cells, resumable scoring per (model, cell), retention.csv and
  its depth / distance splits;
* :mod:`~headscope.evaluation.pairsets`: prompt sets on disk (gzip JSON, never pickle);
* :mod:`~headscope.evaluation.haystack`: the unseen cells' natural-text haystack (corpus, sampled, built-in);
* :mod:`~headscope.evaluation.runner`: ``headscope eval`` (check, load, score, tables);
* :mod:`~headscope.evaluation.report`: report.md and report.html.
"""

from .accuracy import eval_pairs, paired_exact_test, perplexity, prompt_depths, retrieval_accuracy, retrieval_hits, wilson_interval
from .retention import EVAL_COLUMNS, RETENTION_COLUMNS, SuiteConfig, evaluate_suite, load_cells, retention_table
from .runner import EvalConfig, check_eval_args, run_eval

__all__ = [
    "EVAL_COLUMNS",
    "EvalConfig",
    "RETENTION_COLUMNS",
    "SuiteConfig",
    "check_eval_args",
    "eval_pairs",
    "evaluate_suite",
    "load_cells",
    "paired_exact_test",
    "perplexity",
    "prompt_depths",
    "retention_table",
    "retrieval_accuracy",
    "retrieval_hits",
    "run_eval",
    "wilson_interval",
]
