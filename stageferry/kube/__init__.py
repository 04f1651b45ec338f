"""Kubernetes manifests from the pipeline file (``stageferry kube``; ``deploy/kubernetes/``, docs/kubernetes.md).

Modules: :mod:`.values` (what sizes and scales the stages), :mod:`.manifests` (the per-stage objects),
:mod:`.generate` (the generated files, their drift check, the Secret).  Needs PyYAML (the ``kube`` extra).
"""
