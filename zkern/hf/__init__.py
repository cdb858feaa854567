"""zkern for Hugging Face users: zkern.hf.Trainer (transformers.Trainer with a zkern engine), zkern.hf.Accelerator
(accelerate.Accelerator with a zkern engine), fill_auto (the "auto" values of a DeepSpeed-style config from
TrainingArguments) and from_pretrained (each rank reads only its shards).

Needs transformers (and accelerate, which its Trainer needs): pip install "zkern[hf]". `import zkern` does not
import this package.
"""

import importlib

_EXPORTS = {"Trainer": "zkern.hf.trainer", "fill_auto": "zkern.hf.auto", "from_pretrained": "zkern.hf.pretrained",
            "Accelerator": "zkern.hf.accelerator"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zkern.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
