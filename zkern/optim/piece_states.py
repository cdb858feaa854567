"""The optimizers whose per-piece state is not simply `optimizer.state[piece]`: zkern's Adam keeps it in flat buffers
(or in files, NvmeAdam), Muon on NVMe in files. Checkpoints, the state registry and the memory report reach it
through these four methods instead of torch's state dict."""

from __future__ import annotations


class PieceStates:
    """piece_state(group, index) -> {name: tensor or scalar} (a meta tensor: the values are in a file, read through
    the engine's store by name); set_piece_state(group, index, state) ({}: as never stepped); reset_state();
    state_bytes() (host or device memory the states hold)."""

    def piece_state(self, group: int, index: int) -> dict:
        raise NotImplementedError

    def set_piece_state(self, group: int, index: int, state: dict) -> None:
        raise NotImplementedError

    def reset_state(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> int:
        raise NotImplementedError


def load_piece_states(optimizer, state_dict: dict) -> None:
    """torch's optimizer state_dict format into a PieceStates optimizer, piece by piece through set_piece_state (its
    states may be in files): the param groups must match this optimizer's, group for group and piece for piece."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)):
        raise ValueError("the optimizer state_dict has other parameter groups than this engine's shard (another "
                         "world size, stage or model)")
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        group.update({k: v for k, v in saved.items() if k != "params"})
        for i, key in enumerate(saved["params"]):
            optimizer.set_piece_state(gi, i, state_dict["state"].get(key, {}))
