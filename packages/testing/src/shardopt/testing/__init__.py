"""shardopt.testing: multi-process worlds and equivalence checks against torch.optim."""

__all__: list[str] = []
