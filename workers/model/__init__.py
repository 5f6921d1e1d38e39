"""The model runner: the model definitions, checkpoint loading, attention, sampling and prompt
scoring that worker[r] runs over its rank's paged KV pool."""
