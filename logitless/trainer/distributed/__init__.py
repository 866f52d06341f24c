"""Several processes under torchrun: the process group, FSDP2 sharding and its units, FSDP2 CPU offload, the
trainer's only collectives (`collectives`) and sharded checkpoints (`dcp`). On one process each is the identity."""
