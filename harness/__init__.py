"""Reproducibility harness for the vLLM MoE expert-offload patch series.

One module per stage: :mod:`harness.base` (pinned release -> git tree),
:mod:`harness.series` (apply / export / check), :mod:`harness.build`,
:mod:`harness.test`, :mod:`harness.replay` and :mod:`harness.results`.
``python -m harness --help`` lists the commands; ``noxfile.py`` wraps them.
"""
