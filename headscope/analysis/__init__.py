"""Analysis of a ranking and of the heads it names (SPEC.md §7): what is computed from a run, after the sweep.

* :mod:`~headscope.analysis.anatomy` — how importance is spread over heads (critical share, Gini, stability,
  DLA, layer cosine), re-exporting :mod:`~headscope.analysis.dla` and :mod:`~headscope.analysis.stability`;
* :mod:`~headscope.analysis.kappa` — κ, a head's retrieval focus on the evidence span;
* :mod:`~headscope.analysis.knockout` — :func:`~headscope.analysis.knockout.ablate` heads and measure retrieval;
* :mod:`~headscope.analysis.student_anatomy` — the same anatomy for a converted hybrid student;
* :mod:`~headscope.plots` — the plotly figures of all of them.
"""
