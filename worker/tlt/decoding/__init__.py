"""The bottom layer of the rollout stack: the values the engine, the kernels, the verifier and the drafters share.

- kv_cache.py: the ragged KV cache (allocated once, written by position);
- row_state.py: `RowState`, the per-row device state of the active batch;
- sampling.py: the processed sampling distribution and `RowSampling`, a row's settings as device tensors;
- draft_types.py: `DraftProposal` (drafter -> verifier) and `VerifyResult` (verifier -> engine);
- uploads.py: host -> device copies that never wait on the device, and the hook's sequence ids.

Imports only worker/tlt/model; kernels/ build on it, rollout/ above them, speculative/ beside and above the engine
(its arm type, proposer protocol and verifier below it, the controller and the drafters above;
tests/engine/test_engine_layers.py holds the rules).
"""
