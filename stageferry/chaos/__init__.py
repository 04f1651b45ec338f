"""Fault injection for stageferry: the soak runner (``stageferry chaos``) and the failpoints it arms.

Only :mod:`stageferry.failpoints` is imported by the services themselves (a no-op unless
``STAGEFERRY_FAILPOINTS`` is set); everything else here runs in the chaos runner's own process.
"""
