"""A process's random generators (Python, NumPy, torch's CPU and CUDA generators) as plain JSON, for the checkpoints
of zkern.hf.Trainer and zkern.hf.Accelerator: Hugging Face's own code pickles them, and a checkpoint zkern reads never
runs code. A restored state makes dropout, sampling and shuffling draw exactly what they would have drawn.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """This process's generator states as JSON-ready data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "cpu": _bytes(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        # A list, one per device; a single state in Trainer checkpoints of older zkern
        saved = state["cuda"] if isinstance(state["cuda"], list) else [state["cuda"]]
        for device, s in enumerate(saved[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_tensor(s), device)


def check_rng_state(state, where: str) -> None:
    """Raise CheckpointError unless state is what rng_state() writes, decodable into every generator's state (read
    from a checkpoint: checked on every rank before anything is applied)."""
    from zkern.errors import CheckpointError

    try:
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        if _tensor(state["cpu"]).numel() != torch.get_rng_state().numel():
            raise ValueError("the CPU generator's state has the wrong size")
        cuda = state.get("cuda", [])
        for s in cuda if isinstance(cuda, list) else [cuda]:
            _tensor(s)
    except Exception as e:
        raise CheckpointError(f"{where}: not a generator state zkern wrote ({type(e).__name__}: {e})") from None
