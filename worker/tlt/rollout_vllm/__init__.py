"""The vLLM rollout backend (`rollout.backend: vllm`): an in-process `vllm.LLM` colocated with the trainer.
llm.py is the only module that imports vLLM, inside its functions (the `vllm` extra); rollout.py is the trainer's
Rollout on it, drafter.py the online drafter fed from the update's forward, settings.py the spec's translation."""
