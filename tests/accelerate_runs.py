"""Helpers for tests/hf/test_hf_accelerator.py: run examples/accelerate_clm.py's main() in the calling rank, on plain
Accelerate (DDP, the reference) or on zkern.hf.Accelerator with a config, and read back what it logged.
"""

from __future__ import annotations

import json
import os
import runpy

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "accelerate_clm.py")
# What `accelerate launch` exports for an accelerate config with distributed_type DEEPSPEED and a deepspeed_config_file.
LAUNCH_KEYS = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ZKERN_EXAMPLE_ACCELERATOR",
               "ACCELERATE_USE_CPU")


def fresh_accelerate() -> None:
    """Forget the previous run's Accelerate state (a process holds one, as Accelerate's own tests reset it)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_example(argv: list[str], config_path: str | None, **env: str) -> dict:
    """main(argv) of the example in this process: zkern with the config file as `accelerate launch` passes it, or
    plain Accelerate when config_path is None. The module is executed afresh, so the import it picks follows env."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    fresh_accelerate()
    settings = {"ACCELERATE_USE_CPU": "1", **env} if not torch.cuda.is_available() else dict(env)
    if config_path is None:
        settings["ZKERN_EXAMPLE_ACCELERATOR"] = "accelerate"
    else:
        settings.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=config_path)
    saved = {k: os.environ.get(k) for k in set(LAUNCH_KEYS) | set(settings)}
    os.environ.update(settings)
    try:
        module = runpy.run_path(EXAMPLE, run_name="accelerate_clm")
        return module["main"](argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def example_worker(rank: int, world: int, root: str, runs: list[dict]) -> dict:
    """Each run {"name", "config" (dict or None for plain Accelerate), "args"} in turn on this rank; the example
    writes out/<name>/ and logs <name>.jsonl (main process). The example's end_training() destroys the process
    group: give a job one run."""
    results = {}
    for run in runs:
        out = os.path.join(root, run["name"])
        config_path = None
        if run.get("config") is not None:
            config_path = os.path.join(root, f"{run['name']}.rank{rank}.json")  # each rank's own: no race
            with open(config_path, "w") as f:
                json.dump(run["config"], f)
        argv = ["--output_dir", out, "--log_file", os.path.join(root, f"{run['name']}.jsonl"), *run.get("args", [])]
        results[run["name"]] = run_example(argv, config_path, **run.get("env", {}))
    return results


def read_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]
