"""The parallel dimensions over one device mesh: topology and mesh, data parallelism, ZeRO sharding, tensor parallelism, placement of shards."""
