"""A process's random generators (Python, NumPy, torch's CPU and CUDA generators) in one plain-JSON form: the
engine's checkpoints save it per rank (the "generators" state component), and zkern.hf.Trainer and
zkern.hf.Accelerator re-apply it when Hugging Face's loops expect it. Hugging Face's own code pickles these states;
a checkpoint zkern reads never runs code. A restored state makes dropout, sampling and shuffling draw exactly what
they would have drawn.

    python -m pytest tests/checkpoint/test_checkpoint.py tests/hf/test_hf_trainer.py -q
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch

from zkern.errors import CheckpointError


def encode(t: torch.Tensor) -> str:
    """A generator state tensor (bytes) as base64 text."""
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """This process's generator states as JSON-ready data: "python", "numpy", "cpu", and "cuda" (one per device)
    where CUDA is in use."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "cpu": encode(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _cuda_states(state: dict) -> list:
    """The "cuda" entry as a list per device (None where a device's state was not saved); a single state in
    checkpoints of older zkern."""
    saved = state.get("cuda", [])
    return saved if isinstance(saved, list) else [saved]


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned (a checkpoint of older zkern holds the torch generators only: the others
    then stay as they are)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(decode(state["cpu"]))
    if torch.cuda.is_available():
        for device, s in enumerate(_cuda_states(state)[:torch.cuda.device_count()]):
            if s is not None:
                torch.cuda.set_rng_state(decode(s), device)


def check_rng_state(state, where: str) -> None:
    """Raise CheckpointError unless state is what rng_state() writes (or an older zkern's torch-only subset),
    decodable into every generator's state (read from a checkpoint: checked on every rank before anything is
    applied)."""
    try:
        if not isinstance(state, dict):
            raise TypeError(f"a {type(state).__name__}, not a dict")
        if "python" in state:
            version, internal, gauss = state["python"]
            random.Random().setstate((version, tuple(internal), gauss))
        if "numpy" in state:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        if decode(state["cpu"]).numel() != torch.get_rng_state().numel():
            raise ValueError("the CPU generator's state has the wrong size")
        for s in _cuda_states(state):
            if s is not None:
                decode(s)
    except Exception as e:
        raise CheckpointError(f"{where}: not a generator state zkern wrote ({type(e).__name__}: {e})") from None
