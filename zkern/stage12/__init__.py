"""ZeRO stages 0-2: flat buffers per parameter group, bucketed all-reduce or reduce-scatter, sharded optimizer state."""
