"""Scale-out on torch.distributed: tensor-parallel sharding, groups and workers (docs/scaling.md)."""
