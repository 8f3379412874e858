"""TLT: the training library (rollout engine, speculative decoding, drafter, GRPO). Imports nothing from backend/.
The map of the layers, the job path and where to add an algorithm, a reward, a proposer or a model family:
docs/ARCHITECTURE.md."""
