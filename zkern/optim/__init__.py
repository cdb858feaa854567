"""Optimizers over shards: ShardAdam and the shard groups every runtime hands it (shard_adam.py), Lamb and Lion
(lamb_lion.py), DeepSpeed's learning-rate schedules (lr_schedules.py)."""
