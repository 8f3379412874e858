"""Rule-based rewards: math verification (math.py), format and overlong shaping (shaping.py), and the registry of
named reward functions a job spec can use (registry.py, entry-point group `tlt.rewards`)."""
