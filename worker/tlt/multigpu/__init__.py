"""Multi-GPU jobs: data-parallel rollout, idle ranks train the drafter, data-parallel policy update.

    launch.py         start N ranks from the job process, or join a torchrun / deepspeed launch from the environment
    context.py        process group (NCCL / gloo), rendezvous store, the collectives used here
    rollout_shard.py  prompts sharded by rank, per-rank sampling streams, trajectory summaries gathered
    harvest.py        a rank whose shard is done trains the drafter until all are done; drafter broadcast
    update.py         gradient all-reduce (DDP-style) with the global loss normaliser and global clip (torch update);
                      ZeRO stages and offload are DeepSpeed's (`resources.zero_stage`, rl/deepspeed_update.py)
    metrics.py        merge the ranks' step metrics; per-GPU timeline intervals
    data_parallel.py  a rank's GRPOTrainer built from these parts (`build_rank`); the step strategy of train_loop

Limits: `algorithm.dynamic_sampling` is refused (a rank whose groups all drop would skip the optimizer step the
others all-reduce in); lifting it needs GRPOTrainer.update to take its LossNorm from an overridable method and to
step even with no local sequences. Each rank frees its KV cache for the update with
`rollout.release_kv_for_update` (rollout/memory.py; 2.2 GB per rank at 8 x 8 on 2 x H200). No tail rebalancing
between ranks. (Named multigpu, not dist: the repository's .gitignore ignores every `dist/`.)

Wired from train.py: `if spec.resources.gpus > 1: return launch.run(spec, run_dir, reporter, resume)`.
Tests (gloo, 2 CPU processes): `python -m pytest tests/multigpu -q`. Benchmark (2 x H200): `python bench/multi_gpu.py`.
"""
