"""shardopt.optim: drop-in replacements for torch.distributed.optim."""

__all__: list[str] = []
