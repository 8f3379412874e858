"""Speculative decoding (SD): drafters propose, the verifier accepts, a controller picks the arm per decode step.

- arm.py: `Arm`, the shape of a speculative step (drafter, depth, top-k, verify width; `NO_SD` = plain decoding);
- proposers/: the `Proposer` protocol the engine drafts through (protocol.py), the n-gram and small-model drafters,
  draft-tree geometry (draft_tree.py);
- verify/: the lossless verifier (verifier.py), acceptance statistics, the chi-square helpers the tests use;
- control/: the SD controller (`AdaptiveSd`): on/off switch, step costs, per-bucket bandit, the arms per bucket,
  rollout SD metrics, a simulated cost model;
- drafter/: the EAGLE drafter, its proposer, hidden-state buffer, spot trainer, online wiring, warm-up and export.

The engine's own SD step stays in rollout/ (speculative_step.py, speculative_body.py, speculative_graphs.py,
adaptive_loop.py, and controller_protocol.py, the controller protocol it is driven through). The engine imports
arm.py, proposers/protocol.py, proposers/draft_tree.py and verify/ only, never control/, drafter/ or the drafters in
proposers/ (tests/engine/test_engine_layers.py holds the rules); this file imports nothing, so that import stays so.
"""
