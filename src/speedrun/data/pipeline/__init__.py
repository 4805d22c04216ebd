"""How a run is fed batches: choosing the dataset for a recipe, device-resident or streamed
batches, sharding across processes, and pruning examples between epochs."""
