"""The foundations every runtime stands on, torch alone beneath them: shard math (partition.py), the state protocol
(state.py), what a stage runtime answers to the engine (runtime.py), which runtime owns a parameter (owners.py) and
where a shard's bytes live (store.py)."""
