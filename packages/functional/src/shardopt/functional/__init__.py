"""shardopt.functional: stateless ZeRO-1 and ZeRO-2 sharded updates over torch.distributed."""

__all__: list[str] = []
