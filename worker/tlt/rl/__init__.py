"""RL: the algorithms (algorithms/: registry, GRPO, DAPO, Dr.GRPO, GSPO, RLOO, REINFORCE++), token log-probs
(logprobs.py), update batches (batch.py), AdamW + LR schedule (optim.py), the RL step
(trainer.py), the training loop of every job (loop.py), the rollout engine adapter (engine_adapter.py,
rollout_io.py) and checkpoints (checkpoint.py)."""
