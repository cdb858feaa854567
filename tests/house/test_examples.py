"""The examples a user copies run as the README says, draw no warning from zkern and learn their task.

    python -m pytest tests/house/test_examples.py -q
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_train_py_learns_without_a_warning(tmp_path):
    done = run([sys.executable, os.path.join(ROOT, "examples", "train.py")], str(tmp_path))
    assert "zkern:" not in done.stderr, done.stderr  # zkern's warnings go to stderr
    final = float(re.search(r"final loss ([0-9.]+)", done.stdout).group(1))
    assert final < math.log(64) / 4, done.stdout


@pytest.mark.dist
@pytest.mark.slow
def test_hf_trainer_py_under_torchrun_learns_and_saves_a_model_transformers_loads(tmp_path):
    from transformers import GPT2LMHeadModel

    port = __import__("zkern.testing.ranks", fromlist=["free_port"]).free_port()
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                os.path.join(ROOT, "examples", "hf_trainer.py"), str(tmp_path / "out")], str(tmp_path))
    assert "zkern:" not in done.stderr, done.stderr
    losses = [float(x) for x in re.findall(r"eval loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 2 and losses[0] == losses[1] and losses[0] < math.log(64) / 2, done.stdout
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "final")
    assert model.config.n_layer == 2


@pytest.mark.dist
@pytest.mark.slow
def test_accelerate_clm_py_under_accelerate_launch_with_a_deepspeed_config(tmp_path):
    """The real launcher with an accelerate config of distributed_type DEEPSPEED, as a user's own: two processes on
    this machine (no GPU: zkern's Accelerator trains across CPU processes, as DeepSpeed's CPU accelerator does)."""
    from transformers import GPT2LMHeadModel

    port = __import__("zkern.testing.ranks", fromlist=["free_port"]).free_port()
    accel = tmp_path / "accel.yaml"
    accel.write_text("compute_environment: LOCAL_MACHINE\n"
                     "distributed_type: DEEPSPEED\n"
                     "deepspeed_config:\n"
                     f"  deepspeed_config_file: {os.path.join(ROOT, 'examples', 'ds_config_zero3_auto.json')}\n"
                     "  zero3_init_flag: true\n"
                     "num_processes: 2\nnum_machines: 1\nmachine_rank: 0\n")  # precision: the JSON's
    done = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel), "--main_process_port",
                str(port), os.path.join(ROOT, "examples", "accelerate_clm.py"), "--output_dir", str(tmp_path / "out"),
                "--num_train_epochs", "2"], str(tmp_path))
    assert "zkern:" not in done.stderr, done.stderr
    perplexities = [float(x) for x in re.findall(r"perplexity ([0-9.]+)", done.stdout)]
    assert len(perplexities) == 2 and perplexities[1] < perplexities[0] < 67, done.stdout  # 67: a uniform guess
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "final")
    assert model.config.n_layer == 2
