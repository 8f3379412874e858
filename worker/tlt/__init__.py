"""TLT: the training library (rollout engine, speculative decoding, drafter, GRPO). Imports nothing from backend/."""
