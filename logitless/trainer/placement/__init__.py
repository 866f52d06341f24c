"""Where and how a run's rollout decodes: the engine and its replica of the policy, the weight sync, asynchronous
rollouts, one GPU decoding for every rank (`shared_rollout`, its decode process `rollout_worker`) and a replica
split over a group of ranks (`tensor_parallel`)."""


def check_placement(cfg, world_size: int) -> None:
    """Refuse a rollout placement that cannot run on `world_size` ranks (a split or shared rollout), naming the
    setting and the fix."""
    from logitless.trainer.placement.shared_rollout import check_shared_rollout
    from logitless.trainer.placement.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(cfg, world_size)
    check_shared_rollout(cfg, world_size)
