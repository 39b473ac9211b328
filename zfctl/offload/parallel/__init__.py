"""Several processes: the data-parallel gradient exchange and host-state partition, FSDP2
shards, and the world-size-free form of the host state for resharding.
"""
