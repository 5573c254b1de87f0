"""Reproducibility harness for the vLLM MoE expert-offload patch series.

Layers, each importing only those above it:

* :mod:`harness.project` (paths, the pin, git), then :mod:`harness.patches`
  (the series on disk), :mod:`harness.results` (result files),
  :mod:`harness.venv` (the harness venv) and :mod:`harness.touched`;
* :mod:`harness.base` (pinned release -> git tree) and :mod:`harness.applying`
  (one patch onto a tree; a patch applied alone in a base-only clone);
* :mod:`harness.series` (the apply / continue / reset / export / range-diff
  verbs), :mod:`harness.document` and :mod:`harness.checks`;
* the stages :mod:`harness.build`, :mod:`harness.test`, :mod:`harness.lint`,
  :mod:`harness.kernels`, :mod:`harness.bundle`, :mod:`harness.replay`;
* :mod:`harness.matrix`, which classifies the series on each pinned release
  and runs the build and test stages there.

``python -m harness --help`` lists the commands; ``noxfile.py`` wraps them.
"""
