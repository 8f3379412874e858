"""Exports of trained artifacts: the policy as an HF directory (hf.py). Drafter exports live in speculative/drafter/export.py."""
