"""pytest plugin of shardopt.testing."""
