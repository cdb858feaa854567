"""One draw of the differential fuzzer: a combination of what users combine, as plain data (JSON both ways, so a
failing draw prints as a command that repeats it).

    python -c "import random; from zkern.verify.draws import random_draw; print(random_draw(random.Random(1)))"

A draw trains a small GPT (or its routed-experts twin) for `steps` steps on a fixed global batch of GLOBAL
sequences per step, split over `world` ranks and `accumulation` micro-steps, in fp32, bf16 or fp16 (or fp32 weights
under torch_autocast in bf16 or fp16). Events at chosen steps: a
GatheredParameters write from rank 0, a save (sync or async) followed by a load (into the same live engine after a
stray micro-step, or into a fresh engine, possibly of another world size and stage, possibly with layers frozen
from then on, possibly leaving the optimizer, the scheduler or everything but the weights behind), an overflow (the
loss times inf or NaN on any rank, at any micro-step). The optimizer is any zkern takes (the config's Adam, AdamW,
torch_adam, Lamb, Lion, SGD, Adagrad, or a client torch AdamW), and so is the scheduler (DeepSpeed's five, a client
LambdaLR, none). Everything a draw holds is chosen so that the run is defined on any CPU: world 1, 2, 3 or 4 over
gloo. Besides forward, backward, step, a draw may drop a batch's backward with engine.zero_grad() or run an eval
forward under no_grad (or inside gathered_for_generation, as generate() runs), end an accumulation early
(set_gradient_accumulation_boundary) or run a forward whose loss it drops. The loop may be a script written for
Accelerate+DeepSpeed on zkern.hf.Accelerator instead of the engine's own calls (loops.py), or zkern.hf.Trainer's
own (trainer_loop.py, without events between steps). Knobs that must change
nothing the reference sees (overlap, reduce-scatter, bucket sizes, predivide, fp32 communication, stage 3's fetch
units and live bound) are drawn too.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass

GLOBAL = 4  # sequences per optimizer step, whatever the world size and accumulation (6 when a phase runs at world 3)
WORLDS = (1, 2, 3, 4)
CHECKPOINT_FLAVOURS = ("", "non_reentrant", "zkern")
BF16_STATES = ("states", "states_sr", "master", "master_sr")
# Adam_l2: type Adam with adam_w_mode false (L2 in the gradient); torch_adam: AdamW with torch_adam; client: a torch
# AdamW passed as Engine(optimizer=...)
OPTIMIZERS = ("AdamW", "Adam", "Adam_l2", "torch_adam", "client", "Lamb", "Lion", "SGD", "Adagrad", "Muon")
ZKERN_ADAM = ("AdamW", "Adam", "Adam_l2")  # zkern's fused Adam: the only one with bf16 state or NVMe
ADAM_FAMILY = (*ZKERN_ADAM, "torch_adam", "client")
# WarmupLR_log: warmup_type log; client: Engine(lr_scheduler=callable) building a torch LambdaLR; none: no scheduler
SCHEDULERS = ("WarmupLR", "WarmupLR_log", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "client",
              "none")
# what a load leaves behind: load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True
LOAD_FLAGS = ("", "no_optimizer", "no_scheduler", "module_only")
FRONTENDS = ("engine", "accelerator", "trainer")


@dataclass(frozen=True)
class Draw:
    seed: int = 0
    steps: int = 4
    world: int = 2
    stage: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16
    autocast: str = ""  # "" | bf16 | fp16: fp32 weights, the forward under torch_autocast in that dtype
    # bf16 optimizer state: "" | states (bf16 moments) | master (bf16 master and moments); "_sr": rounded
    # stochastically (bf16_stochastic_rounding)
    bf16_state: str = ""
    accumulation: int = 1
    clip: float = 0.0
    lr: float = 1e-2
    groups: bool = False  # decay / no-decay parameter groups (model_parameters)
    arch: str = "tiny"  # tiny | moe (routed experts: each rank's data picks its experts)
    frozen: str = "none"  # none | start (qkv and fc frozen from the start) | load (frozen from the load on)
    checkpoint: str = ""  # activation checkpointing of each block: "" | non_reentrant | zkern
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3, with offload_optimizer)
    delayed_update: bool = False  # offload_optimizer.delayed_update: the host Adam one step behind (ZeRO-Offload's DPU)
    staging_chunks: int = 4  # offload_optimizer.staging_chunks: the host staging's ring of chunk buffers (0: none)
    speculative: bool = False  # offload_optimizer.speculative_step: the chunks' Adam in backward, kept or undone
    offload_ratio: float = 1.0  # offload_optimizer.ratio: that share of the shard on the host, the rest on the device
    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    loco: bool = False
    optimizer: str = "AdamW"  # one of OPTIMIZERS
    scheduler: str = "WarmupLR"  # one of SCHEDULERS
    write_at: int = -1  # GatheredParameters(modifier_rank=0) write before this step's forward; -1: none
    set_at: int = -1  # safe_set_full_fp32_param of the same parameter after this step's last backward, before its
    # step() (the engine frontend); -1: none
    overflow_at: int = -1  # this step's loss times inf on one rank (every rank skips the step); -1: none
    overflow_rank: int = 0  # the rank whose loss overflows
    overflow_micro: int = 0  # the micro-step at which it does
    overflow_nan: bool = False  # NaN instead of inf
    save_at: int = -1  # save after this step (1 .. steps - 1), then load; -1: none
    async_save: bool = False
    load_into: str = "fresh"  # live (the same engine, after one stray micro-step) | fresh (a new engine)
    load_flags: str = ""  # one of LOAD_FLAGS
    world_after: int = 0  # fresh loads: the world size after the load (0: the same)
    stage_after: int = -1  # fresh loads: the stage after the load (-1: the same)
    # call orders a training loop makes besides forward, backward, step
    dropped_at: int = -1  # this step begins with a batch whose backward is then dropped by engine.zero_grad()
    eval_at: int = -1  # this step begins with an eval forward under torch.no_grad() (engine.eval(), then train())
    eval_generation: bool = False  # that forward inside engine.gathered_for_generation() (stage 3 pins every unit)
    short_at: int = -1  # this step's accumulation ends after its first micro-step (set_gradient_accumulation_boundary)
    spare_forward_at: int = -1  # this step begins with a forward whose loss is dropped unused (grad enabled)
    # knobs that must change nothing the reference can see (16-bit dtypes within the 16-bit bar)
    overlap: bool = True  # overlap_comm
    reduce_scatter: bool = True
    bucket: int = 3000  # reduce_bucket_size (stage 3's prefetch bucket too)
    predivide: float = 0.0  # gradient_predivide_factor (0: the default, the world size)
    fp32_comm: bool = False  # communication_data_type fp32 and data_types.grad_accum_dtype fp32 (16-bit draws)
    block_units: bool = False  # stage 3: stage3_fetch_units ["Block"]
    max_live: int = 0  # stage 3: stage3_max_live_parameters (0: the default)
    keep_working: bool = False  # stage 3: stage3_keep_working_shard (a 16-bit shard beside the master to gather from)
    muon_in_memory: bool = False  # Muon on NVMe: save_muon_momentum_buffer_in_memory (the momentum off the files)
    # who drives the engine: "engine" (its own calls), "accelerator" (a script written for Accelerate+DeepSpeed, on
    # zkern.hf.Accelerator: loops.py) or "trainer" (zkern.hf.Trainer's loop: trainer_loop.py)
    frontend: str = "engine"
    # a model whose module hands its parameters out as views (returned, expanded, kept on itself: TinyGPT's ViewTap)
    views: bool = False
    # after this step: a save (sync and async, of a scratch tag), full_state_dict, full_working_state_dict,
    # stream_full_weights and GatheredParameters entered to write without writing; the same draw without them (its
    # twin) must match bit for bit. -1: none
    reads_at: int = -1

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        """Comparable with the fp32 reference to float32 rounding (no 16-bit math, no quantized collective)."""
        return self.precision == "fp32" and not (self.qwz or self.qgz or self.autocast)

    @property
    def global_size(self) -> int:
        """Sequences per optimizer step: 4, or 6 where a phase runs at world 3."""
        return 6 if any(w == 3 for w, _, _, _ in self.phases) else GLOBAL

    @property
    def phases(self) -> list[tuple[int, int, int, int]]:
        """(world, stage, first step, last step + 1) of each engine lifetime."""
        if self.save_at < 0 or self.load_into == "live":
            return [(self.world, self.stage, 0, self.steps)]
        world = self.world_after or self.world
        stage = self.stage_after if self.stage_after >= 0 else self.stage
        return [(self.world, self.stage, 0, self.save_at + 1), (world, stage, self.save_at + 1, self.steps)]

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v != getattr(Draw, k)},
                          sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Draw:
        values = json.loads(text)
        unknown = set(values) - {f.name for f in dataclasses.fields(Draw)}
        if unknown:
            raise ValueError(f"draw fields {sorted(unknown)} are not Draw's")
        return Draw(**values).checked()

    def repro(self) -> str:
        return f"python -m zkern.verify.fuzz --draw '{self.to_json()}'"

    # -- what may be combined -----------------------------------------------------------------------------------
    def checked(self) -> Draw:
        """The draw if it is a valid combination, else ValueError naming the clash."""
        problems = []
        for world in {w for w, _, _, _ in self.phases}:
            if world not in WORLDS or self.global_size % (world * self.accumulation):
                problems.append(f"world {world} x accumulation {self.accumulation} must divide {self.global_size}")
        stages = {s for _, s, _, _ in self.phases}
        if self.offload_optimizer != "none" and 0 in stages:
            problems.append("offload_optimizer needs stage 1-3")
        if self.offload_param != "none" and (stages != {3} or self.offload_optimizer == "none"):
            problems.append("offload_param needs stage 3 throughout and offload_optimizer")
        if (self.qwz or self.hpz) and stages != {3}:
            problems.append("qwZ/hpZ need stage 3 throughout")
        if self.qgz and not stages <= {2, 3}:
            problems.append("qgZ needs stage 2 or 3 throughout")
        if self.loco and not self.qgz:
            problems.append("LoCo needs qgZ")
        if self.hpz and any(w % 2 or w < 2 for w, _, _, _ in self.phases):
            problems.append("hpZ (groups of 2) needs an even world of 2 or more")
        if self.frozen == "load" and (self.save_at < 0 or self.load_into == "live"):
            problems.append("frozen at load needs a load into a fresh engine")
        if (self.world_after or self.stage_after >= 0) and (self.save_at < 0 or self.load_into == "live"):
            problems.append("another world or stage after the load needs a load into a fresh engine")
        if self.save_at >= 0 and not 0 <= self.save_at < self.steps - 1:
            problems.append("save_at must leave at least one step after it")
        if self.fp32_comm and self.precision == "fp32":
            problems.append("fp32_comm is for 16-bit draws")
        if (self.block_units or self.max_live) and stages != {3}:
            problems.append("block_units and max_live need stage 3 throughout")
        if not self.reduce_scatter and self.qgz:
            problems.append("qgZ needs reduce_scatter")
        for name in ("write_at", "set_at", "overflow_at", "dropped_at", "eval_at", "short_at", "spare_forward_at",
                     "reads_at"):
            if getattr(self, name) >= self.steps:
                problems.append(f"{name} beyond the last step")
        if self.autocast and (self.autocast not in ("bf16", "fp16") or self.precision != "fp32" or self.qwz):
            problems.append("autocast is bf16 or fp16, over fp32 weights, without qwZ (which torch_autocast refuses)")
        if self.bf16_state and (self.bf16_state not in BF16_STATES or self.precision != "bf16" or 0 in stages):
            problems.append(f"bf16_state must be one of {BF16_STATES}, with bf16 and stage 1-3 throughout")
        if self.optimizer not in OPTIMIZERS or self.scheduler not in SCHEDULERS or self.load_flags not in LOAD_FLAGS:
            problems.append(f"optimizer, scheduler and load_flags must be among {OPTIMIZERS}, {SCHEDULERS} and "
                            f"{LOAD_FLAGS}")
        if (self.bf16_state or "nvme" in (self.offload_optimizer, self.offload_param)) and \
                self.optimizer not in ZKERN_ADAM and not (self.optimizer == "Muon" and not self.bf16_state):
            problems.append(f"bf16 optimizer state and NVMe offload need zkern's Adam ({ZKERN_ADAM}) or, NVMe, Muon")
        if self.muon_in_memory and (self.optimizer != "Muon" or self.offload_optimizer != "nvme"):
            problems.append("muon_in_memory needs Muon with offload_optimizer nvme")
        if self.delayed_update and (self.offload_optimizer != "cpu" or self.offload_param == "nvme"
                                    or self.optimizer not in ZKERN_ADAM):
            problems.append(f"delayed_update needs offload_optimizer cpu, no NVMe parameters and zkern's Adam "
                            f"({ZKERN_ADAM})")
        if self.speculative and (self.offload_optimizer != "cpu" or self.offload_param == "nvme"
                                 or self.delayed_update or self.optimizer not in ZKERN_ADAM):
            problems.append(f"speculative needs offload_optimizer cpu, no NVMe parameters, no delayed_update and "
                            f"zkern's Adam ({ZKERN_ADAM})")
        if self.offload_ratio != 1.0 and (self.offload_optimizer != "cpu" or self.offload_param != "none"
                                          or self.delayed_update or self.speculative
                                          or not 0.0 <= self.offload_ratio < 1.0):
            problems.append("offload_ratio (partial offload) needs offload_optimizer cpu without offload_param, "
                            "delayed_update or speculative, and a ratio in [0, 1)")
        if self.optimizer == "Lion" and not self.exact:
            # Lion steps by sign(c): a rounding that flips a small c moves the element a whole 2 lr, so 16-bit and
            # quantized Lion runs end 0.22-0.8 of the untrained distance from the fp32 reference even on one rank
            # (Adam: 0.004-0.34), and 0.03-0.25 from a reference computing in their own 16-bit dtype (Adam: at most
            # 0.032): no bound that admits them fails a Lion that never trains (1.0). Held to the fp32 reference
            # exactly.
            problems.append("Lion is drawn in exact draws only (fp32, no qwZ/qgZ)")
        if self.optimizer == "Muon" and (self.precision != "fp32" or self.autocast or self.qgz):
            # Newton-Schulz normalizes each matrix and stretches its small singular directions by up to
            # 3.4445^5 = 487: a bf16 working weight that rounds the other way after one step (zkern's fp32 "gram"
            # iteration against the reference's fp64) moves the next steps' updates along them. A correct bf16 run at
            # world 1 ended 0.10 of the untrained distance from the same-arithmetic reference (seed 821163), where
            # Adam ends at 0: no 16-bit bound both admits it and means much. 16-bit Muon is the unit tests' to hold
            # (tests/optim/test_muon.py: bf16 resumes bit for bit).
            # fp32 with qwZ or hpZ is drawn (the reference redoes qwZ's int8 gathers: 15 focused draws passed,
            # 2026-11-28). qgZ is not: its int4 gradient noise, orthogonalized, ends correct runs 0.78 and 0.81 of the
            # untrained distance from the fp32 reference (seeds 440797, 164523), past the 0.75 that Adam's qgZ draws
            # hold; Muon with qgZ trains (tests/optim/test_muon.py), held there to its own bar.
            problems.append("Muon is drawn in fp32 only, without qgZ (qwZ and hpZ allowed; no 16-bit, no "
                            "torch_autocast)")
        if self.short_at >= 0 and (self.accumulation < 2 or (self.short_at == self.overflow_at
                                                            and self.overflow_micro > 0)):
            problems.append("short_at needs accumulation 2 or more (and an overflow there at micro-step 0)")
        if self.eval_generation and self.eval_at < 0:
            problems.append("eval_generation needs eval_at")
        if self.load_flags and self.save_at < 0:
            problems.append("load_flags need a save and load")
        if self.overflow_rank >= min(w for w, _, _, _ in self.phases) or self.overflow_micro >= self.accumulation:
            problems.append("overflow_rank must be a rank of every phase and overflow_micro a micro-step")
        if self.frontend not in FRONTENDS:
            problems.append(f"frontend must be one of {FRONTENDS}")
        if self.set_at >= 0 and self.frontend != "engine":
            # Accelerate's backward steps inside it and the Trainer runs its own loop: no call between the two
            problems.append("set_at needs the engine frontend (a call between backward and step())")
        if self.frontend == "accelerator" and (
                self.scheduler == "client" or self.async_save or self.dropped_at >= 0 or self.short_at >= 0):
            # a script on Accelerate steps a torch scheduler itself, saves synchronously (save_state), and has no
            # call that drops a batch's gradients (optimizer.zero_grad does nothing under DeepSpeed) or ends an
            # accumulation early outside its own data loader's last batch
            problems.append("the accelerator frontend draws no client scheduler, async saves, dropped batches or "
                            "short accumulations")
        if self.frontend == "trainer" and (
                not self.groups or self.scheduler == "client" or self.save_at >= 0 or self.write_at >= 0
                or self.eval_at >= 0 or self.dropped_at >= 0 or self.short_at >= 0 or self.spare_forward_at >= 0):
            # the Trainer runs the whole loop (no events between its steps), splits decay/no-decay groups itself
            # and steps a torch scheduler of its own
            problems.append("the trainer frontend draws decay/no-decay groups and no client scheduler, saves, "
                            "writes, evaluations, dropped batches, short accumulations or spare forwards")
        if self.views and self.arch != "tiny":
            problems.append("views is a variant of the tiny arch")
        if self.reads_at >= 0 and self.frontend != "engine":
            problems.append("reads_at needs the engine frontend (its calls between steps)")
        if self.checkpoint not in CHECKPOINT_FLAVOURS or self.arch not in ("tiny", "moe"):
            problems.append("unknown checkpoint flavour or arch")
        if problems:
            raise ValueError(f"invalid draw {self.to_json()}: " + "; ".join(problems))
        return self


def random_draw(rng: random.Random, worlds: tuple[int, ...] = WORLDS, nvme: bool = True) -> Draw:
    """A random valid combination (worlds: the world sizes allowed; nvme: whether NVMe offload may be drawn)."""
    while True:
        world = rng.choice(worlds)
        stage = rng.choice((0, 1, 2, 3))
        precision = rng.choice(("fp32", "fp32", "bf16", "fp16"))
        steps = rng.choice((3, 4, 5))
        values = dict(seed=rng.randrange(1 << 20), steps=steps, world=world, stage=stage, precision=precision,
                      accumulation=rng.choice((1, 1, 2)), clip=rng.choice((0.0, 0.0, 0.05)),
                      groups=rng.random() < 0.4, arch=rng.choice(("tiny", "tiny", "moe")),
                      frozen=rng.choice(("none", "none", "start", "load")),
                      checkpoint=rng.choice(CHECKPOINT_FLAVOURS))
        offloads = ("none", "none", "cpu") + (("nvme",) if nvme else ())
        if stage > 0:
            values["offload_optimizer"] = rng.choice(offloads)
        if stage == 3 and values["offload_optimizer"] != "none" and rng.random() < 0.5:
            values["offload_param"] = rng.choice(offloads[2:])
        if stage == 3:
            values["qwz"] = rng.random() < 0.2
            values["hpz"] = world >= 2 and world % 2 == 0 and rng.random() < 0.2
        if stage >= 2 and world >= 2:
            values["qgz"] = rng.random() < 0.2
            values["loco"] = values["qgz"] and rng.random() < 0.5
        if rng.random() < 0.3:
            values["write_at"] = rng.randrange(steps)
        if rng.random() < 0.15:
            values["set_at"] = rng.randrange(steps)
        if rng.random() < (0.5 if precision == "fp16" else 0.15):
            values["overflow_at"] = rng.randrange(steps)
        if rng.random() < 0.6:
            values["save_at"] = rng.randrange(steps - 1)
            values["async_save"] = rng.random() < 0.4
            values["load_into"] = rng.choice(("live", "fresh", "fresh"))
            if values["load_into"] == "fresh" and rng.random() < 0.4:
                values["world_after"] = rng.choice([w for w in worlds if w != world] or [world])
                values["stage_after"] = rng.choice((0, 1, 2, 3))
        if precision == "fp32" and not values.get("qwz") and rng.random() < 0.2:
            values["autocast"] = rng.choice(("bf16", "bf16", "fp16"))
        if precision == "bf16" and stage > 0 and rng.random() < 0.4:
            values["bf16_state"] = rng.choice(BF16_STATES)
        if rng.random() < 0.2:
            values["dropped_at"] = rng.randrange(steps)
        if rng.random() < 0.2:
            values["eval_at"] = rng.randrange(steps)
            values["eval_generation"] = rng.random() < 0.5
        if values["accumulation"] > 1 and rng.random() < 0.3:
            values["short_at"] = rng.randrange(steps)
        if rng.random() < 0.15:
            values["spare_forward_at"] = rng.randrange(steps)
        values["views"] = values["arch"] == "tiny" and rng.random() < 0.2
        if rng.random() < 0.2:
            values["reads_at"] = rng.randrange(steps)
        values["overlap"] = rng.random() < 0.8
        values["reduce_scatter"] = rng.random() < 0.85
        values["bucket"] = rng.choice((3000, 3000, 1000, 50_000))
        if world > 1 and rng.random() < 0.15:
            values["predivide"] = rng.choice((1.0, 2.0))
        if precision != "fp32" and rng.random() < 0.25:
            values["fp32_comm"] = True
        if stage == 3:
            values["block_units"] = rng.random() < 0.3
            if rng.random() < 0.2:
                values["max_live"] = rng.choice((20_000, 60_000))
            if rng.random() < 0.2:
                values["keep_working"] = True
        values["optimizer"] = rng.choice(OPTIMIZERS[:1] * 4 + OPTIMIZERS[1:])
        values["scheduler"] = rng.choice(SCHEDULERS[:1] * 3 + SCHEDULERS[1:])
        if values["optimizer"] == "Muon" and values.get("offload_optimizer") == "nvme":
            values["muon_in_memory"] = rng.random() < 0.5
        if values.get("offload_optimizer") == "cpu" and values.get("offload_param") != "nvme" and \
                values["optimizer"] in ZKERN_ADAM and rng.random() < 0.5:
            values["delayed_update"] = True
        if values.get("offload_optimizer") == "cpu" and values.get("offload_param") != "nvme" and \
                not values.get("delayed_update") and values["optimizer"] in ZKERN_ADAM and rng.random() < 0.5:
            values["speculative"] = True
        if values.get("offload_optimizer") == "cpu" and rng.random() < 0.4:  # a smaller ring reuses its buffers more
            values["staging_chunks"] = rng.choice((0, 1, 2))
        if values.get("offload_optimizer") == "cpu" and values.get("offload_param", "none") == "none" and not (
                values.get("delayed_update") or values.get("speculative")) \
                and rng.random() < 0.3:  # partial offload: the shard's start on the device
            values["offload_ratio"] = rng.choice((0.0, 0.3, 0.5, 0.8))
        if "overflow_at" in values:
            values["overflow_rank"] = rng.randrange(world)
            values["overflow_micro"] = rng.randrange(values["accumulation"])
            values["overflow_nan"] = rng.random() < 0.3
        if "save_at" in values and rng.random() < 0.3:
            values["load_flags"] = rng.choice(LOAD_FLAGS[1:])
        frontend = rng.random()
        if frontend < 0.15:  # the draw's loop as an Accelerate script, without what such a script cannot say
            values.update(frontend="accelerator", async_save=False, dropped_at=-1, short_at=-1, set_at=-1, reads_at=-1)
        elif frontend < 0.25:  # trained by zkern.hf.Trainer: its own loop, HF's decay/no-decay groups
            values.update(frontend="trainer", groups=True, save_at=-1, async_save=False, load_into="fresh",
                          load_flags="", world_after=0, stage_after=-1, write_at=-1, eval_at=-1,
                          eval_generation=False, dropped_at=-1, short_at=-1, spare_forward_at=-1, set_at=-1,
                          reads_at=-1)
            if values["frozen"] == "load":
                values["frozen"] = "none"
        if values.get("frontend", "engine") != "engine" and values["scheduler"] == "client":
            values["scheduler"] = "WarmupLR"
        try:
            return Draw(**values).checked()
        except ValueError:
            continue  # a clash (e.g. offload with a stage-0 phase after the load): draw again
