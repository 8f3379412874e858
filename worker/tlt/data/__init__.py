"""Prompt datasets for RL: loading (JSONL / parquet / built-ins), the validation split, prompt rendering with the
tokenizer's chat template, and the resumable prompt sampler. See dataset.py, toy.py, prompts.py, sampler.py."""
