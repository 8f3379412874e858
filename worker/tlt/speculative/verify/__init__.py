"""The verifier: exact (lossless) acceptance of a draft chain or tree against the target (verifier.py), the
acceptance statistics of speculative steps (accept_stats.py), and chi-square helpers that check sampled tokens follow
an exact distribution (stat_tests.py, for the tests and the self-check).
"""
