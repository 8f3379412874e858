"""RL algorithms as parts: an `Algorithm` (base.py) bundles an advantage estimator, a policy loss and its
aggregation (which also fixes the data-parallel normaliser); the built-ins are in builtin.py, the registry that the
job spec's `algorithm.name` is resolved in (and that the control plane lists, without torch) in registry.py.
Adding one: docs/ARCHITECTURE.md ("Where to add")."""
