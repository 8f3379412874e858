"""TLT's adaptive drafter: `model.EagleDrafter` (EAGLE-1 / EAGLE-3), `buffer.HiddenStateBuffer` + `EngineCapture`,
`spot_trainer.SpotTrainer`, `eagle_proposer.EagleProposer` (a `Proposer`, speculative/proposers/protocol.py), `export` (vLLM / SGLang directories),
`online.OnlineDrafter` (RL-loop wiring), `warmup.warmup` (the `drafter` job), `measure` (GPU accept-length table).

Run the tests: `python -m pytest tests/drafter -q`.
"""
