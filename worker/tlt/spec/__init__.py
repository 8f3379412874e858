"""Speculative decoding: drafters propose, the verifier accepts. See types.py for the one structure they share."""
