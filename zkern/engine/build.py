"""Engine construction: device, initial broadcast, parameter groups, optimizer and LR scheduler.

    python -m pytest tests/engine/test_engine_build.py -q

Each function does one step of zkern.Engine.__init__ and raises a clear error on input it cannot take.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from zkern import ops
from zkern.comm.collectives import Comm, device_from_config
from zkern.comm.zeropp import QuantizedReduce
from zkern.config import Config, ConfigError
from zkern.core.runtime import Runtime
from zkern.core.shard_groups import ShardGroup
from zkern.core.spec import RuntimeSpec
from zkern.engine import muon_groups
from zkern.offload import nvme
from zkern.offload.nvme import NvmeAdam
from zkern.offload.nvme_muon import NvmeMuon
from zkern.offload.store import ShardStore
from zkern.optim.lamb_lion import Lamb, Lion
from zkern.optim.lr_schedules import build_scheduler
from zkern.optim.muon import ShardMuon
from zkern.optim.muon_owners import Ranks
from zkern.optim.shard_adam import ShardAdam
from zkern.stage3.runtime import Stage3Runtime
from zkern.stage3.sharded_init import is_sharded
from zkern.stage12.runtime import Stage12Runtime

log = logging.getLogger("zkern")


def pick_device(model: torch.nn.Module, want: str) -> torch.device:
    """Where this rank trains. want "cpu" or "cuda" (config key 'device') decides; "auto" keeps a model that
    is already on a CUDA device, else takes cuda:LOCAL_RANK when CUDA is available (as DeepSpeed moves the
    module), else the CPU."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                         f"zkern trains a model that lives on one device per rank")
    current = devices.pop() if devices else torch.device("cpu")
    if current.type == "cuda" and want != "cpu":
        return current
    return device_from_config(want)


def broadcast_state(model: torch.nn.Module, comm: Comm, chunk_numel: int, params: bool = True) -> None:
    """Give every rank rank 0's parameters (unless params is false) and buffers, as DDP does: per dtype and device,
    flattened in chunks of at most chunk_numel elements (a larger tensor alone, in place), so the copy never holds
    more than one chunk beside the model."""
    if comm.world == 1:
        return
    tensors = [*(model.parameters() if params else ()), *model.buffers()]
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in {id(t): t for t in tensors}.values():
        by_kind[(str(t.dtype), str(t.device))].append(t)
    with torch.no_grad():
        for (dtype, device), group in sorted(by_kind.items()):
            chunk: list[torch.Tensor] = []
            for t in group + [None]:
                if t is not None and t.numel() >= chunk_numel and t.is_contiguous():
                    comm.broadcast(t.data, f"initial {dtype} values on {device} from rank 0")
                    continue
                if chunk and (t is None or sum(c.numel() for c in chunk) + t.numel() > chunk_numel):
                    flat = ops.flatten([c.detach() for c in chunk])
                    comm.broadcast(flat, f"initial {dtype} values on {device} from rank 0")
                    offset = 0
                    for c in chunk:
                        c.copy_(flat[offset:offset + c.numel()].view(c.shape))
                        offset += c.numel()
                    chunk = []
                if t is not None:
                    chunk.append(t)


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in model.named_parameters() (tied parameters appear once)."""
    return {id(p): name for name, p in model.named_parameters()}


# What a param-group dict may set for the config's optimizer (the rest of its options come from the config).
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def requested_groups(model_parameters) -> list[dict]:
    """deepspeed.initialize's model_parameters as a list of group dicts: an iterable of parameters (one group) or of
    dicts with "params" and per-group options (GROUP_KEYS)."""
    if isinstance(model_parameters, torch.Tensor):
        raise TypeError("model_parameters is one tensor; pass an iterable of parameters or of param-group dicts")
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters is empty; pass the parameters to train (or leave it out to train all)")
    if all(isinstance(i, torch.Tensor) for i in items):
        return [{"params": items}]
    if not all(isinstance(i, dict) for i in items):
        raise TypeError("model_parameters mixes tensors and dicts; pass either parameters or param-group dicts")
    groups = []
    for gi, group in enumerate(items):
        if "params" not in group:
            raise ValueError(f"model_parameters group {gi} has no 'params' entry")
        unknown = sorted(set(group) - {"params", "name", *GROUP_KEYS})
        if unknown:
            raise ValueError(f"model_parameters group {gi} sets {unknown}; the config's optimizer takes per-group "
                             f"{list(GROUP_KEYS)} (and 'name')")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        groups.append({**group, "params": params})
    return groups


def trainable_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     requested: list[dict] | None = None) -> list[list[torch.nn.Parameter]]:
    """The parameter groups zkern trains: the client optimizer's groups, the requested groups
    (model_parameters), or one group of all trainable params.

    Every parameter that requires grad must be in exactly one group; groups hold only the model's own parameters.
    Frozen parameters in a group are left out of it (a torch optimizer skips them too; DeepSpeed leaves them out), so
    model.parameters() of a partly frozen model can be passed as it is.
    """
    names = param_names(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None and requested is None:
        return [trainable]
    what = "optimizer param group" if optimizer is not None else "model_parameters group"
    source = optimizer.param_groups if optimizer is not None else requested
    groups, seen = [], set()
    for gi, group in enumerate(source):
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"{what} {gi} holds a tensor of shape {tuple(p.shape)} that is not "
                                 f"a parameter of the model; build the groups from model.parameters()")
            if not p.requires_grad:  # model.parameters() of a partly frozen model (LoRA): skipped, as torch does
                continue
            params.append(p)
            if id(p) in seen:
                raise ValueError(f"parameter '{names[id(p)]}' is in two param groups ({what} {gi} and an earlier "
                                 f"one); each parameter belongs to one group")
            seen.add(id(p))
        groups.append(params)
    missing = [names[id(p)] for p in trainable if id(p) not in seen]
    if missing:
        raise ValueError(f"parameters {missing} require grad but are in no {what}; add them to a group, "
                         f"or freeze them with requires_grad_(False)")
    if optimizer is not None and optimizer.state:
        raise ValueError("the optimizer passed to zkern.Engine already has state; pass a fresh optimizer and "
                         "restore state through the engine")
    return groups


def check_dtypes(groups: list[list[torch.nn.Parameter]], model: torch.nn.Module) -> None:
    """fp32 training: every trainable parameter must be float32 (it is its own master copy)."""
    names = param_names(model)
    for group in groups:
        for p in group:
            if p.dtype != torch.float32:
                raise TypeError(
                    f"parameter '{names[id(p)]}' is {p.dtype}; zkern keeps fp32 master weights and expects the "
                    f"model in float32 (call model.float()); for 16-bit training set \"bf16\" or \"fp16\" "
                    f"{{\"enabled\": true}} in the config and zkern casts the model itself")


def group_options(cfg: Config) -> dict:
    o = cfg.optimizer
    return {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay, "adamw": o.adamw}


# The config's other optimizers: the torch (or zkern) class and the section params it takes.
_OTHERS = {"sgd": (torch.optim.SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")),
           "adagrad": (torch.optim.Adagrad, ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")),
           "lion": (Lion, ("lr", "betas", "weight_decay")),
           "lamb": (Lamb, ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"))}


def _other_optimizer(cfg: Config, shard_groups: list[ShardGroup], requested: list[dict] | None):
    """SGD, Adagrad, Lion or Lamb over the shard pieces, one param group per requested group (its lr, weight_decay,
    betas and eps over the section's)."""
    o = cfg.optimizer
    cls, names = _OTHERS[o.type]
    base = {k: o.params[k] for k in names if k in o.params}
    if "betas" in base:
        base["betas"] = tuple(base["betas"])
    overrides = [{k: g[k] for k in GROUP_KEYS if k in g and k in names} for g in requested or [{}] * len(shard_groups)]
    if o.type == "sgd" and base.get("nesterov") and (base.get("momentum", 0) <= 0 or base.get("dampening", 0) != 0):
        raise ConfigError("'optimizer.params.nesterov' needs momentum > 0 and dampening 0 (torch's SGD rule)")
    return cls([{"params": g.pieces, **base, **ov} for g, ov in zip(shard_groups, overrides)], **base)


def optimizer_side(cfg: Config, spec: RuntimeSpec, runtime: Runtime, comm: Comm, store: ShardStore,
                   nvme_shard: nvme.NvmeShard | None, client, lr_scheduler, requested: list[dict] | None, *,
                   inference: bool):
    """(host_step, optimizer, lr_scheduler) of a built runtime: with offload the optimizer sees the host staging's
    shard groups (host master, gradient and parameter buffers); an engine without an optimizer has none of them."""
    from zkern.offload.host import HostStep

    if inference:
        return None, None, None
    zero = cfg.zero_optimization
    shard_groups, host_step = runtime.shard_groups, None
    if spec.offloaded:
        # the ring of staging buffers needs zkern's own Adam (build_optimizer's ShardAdam), stepping chunk by chunk
        per_chunk = (client is None and cfg.optimizer is not None and cfg.optimizer.type in ("adam", "adamw")
                     and not cfg.optimizer.torch_adam and nvme_shard is None)
        host_step = HostStep(shard_groups, pin=spec.pin_optimizer, out_on_host=zero.offload_param_device != "none",
                             store=store, during_backward=zero.offload_optimizer_copy_grads_during_backward,
                             delayed=zero.offload_optimizer_delayed_update,
                             staging_chunks=zero.offload_optimizer_staging_chunks, per_chunk=per_chunk,
                             speculative=zero.offload_optimizer_speculative_step
                             or zero.offload_optimizer_super_offload)
        if host_step.delayed or host_step.speculative:  # its Adam runs beside the training thread: a share of cores
            host_step.background_threads = ops.cpu_adam_threads(zero.offload_optimizer_cpuadam_cores_perc)
        if host_step.during_backward:  # each gradient region goes to the host as its reduction lands
            runtime.on_final_grads = host_step.grad_final
        if host_step.delayed or host_step.speculative:  # what reads or writes a shard waits for the update in the
            store.delayed = host_step  # background, or withdraws the speculative one (store.py)
        if host_step.delayed:
            host_step.on_landed = runtime.refresh  # landed outside a step too: the whole copies follow
        shard_groups = host_step.host_groups
    optimizer = build_optimizer(cfg, client, shard_groups, requested, nvme=nvme_shard, rank=comm.rank, spec=spec)
    if host_step is not None and host_step.speculative and isinstance(optimizer, ShardAdam):
        optimizer.keep_saves()  # the speculative step's rollback, allocated (and counted) from the start
    attach_layout(optimizer, runtime, comm, zero.stage, store.device)
    return host_step, optimizer, build_scheduler_for(cfg, lr_scheduler, optimizer)


def build_optimizer(cfg: Config, client: torch.optim.Optimizer | None, shard_groups: list[ShardGroup],
                    requested: list[dict] | None = None, nvme=None, *, rank: int = 0,
                    spec: RuntimeSpec | None = None) -> torch.optim.Optimizer:
    """zkern's fused ShardAdam from the config (one group per requested group, its options over the config's), or
    the client's torch optimizer re-pointed at the shard pieces. nvme: the NvmeShard holding the master and moments
    (offload_optimizer.device "nvme"): zkern's Adam steps them there (nvme.NvmeAdam). rank: seeds this rank's
    stochastic rounding. spec: the Adam moments' dtype and rounding (RuntimeSpec.state_dtype, .stochastic_rounding;
    fp32 without it)."""
    _check_bf16_state_optimizer(cfg, client)
    if nvme is not None and (client is not None or (cfg.optimizer is not None and cfg.optimizer.torch_adam)):
        raise ConfigError("zero_optimization.offload_optimizer.device \"nvme\" steps zkern's own Adam/AdamW over the "
                          "state files: give the optimizer in the config's 'optimizer' section (type Adam or AdamW, "
                          "without torch_adam) instead of a torch optimizer")
    if client is not None and cfg.optimizer is not None:
        raise ConfigError("an optimizer is given twice: in the config's 'optimizer' section and as "
                          "Engine(optimizer=...); keep one")
    if client is None and cfg.optimizer is None:
        raise ConfigError("no optimizer: add an 'optimizer' section to the config (e.g. {\"type\": \"AdamW\", "
                          "\"params\": {\"lr\": 1e-4}}) or pass Engine(model, cfg, optimizer=torch_optimizer)")
    if client is None and cfg.optimizer.type == "muon":
        if requested is None or any("use_muon" not in r for r in requested):
            raise ValueError("Muon's optimizer groups are made by muon_groups.split (each half tagged use_muon)")
        groups = muon_groups.optimizer_groups(cfg, [g.pieces for g in shard_groups], requested)
        if nvme is not None:
            return NvmeMuon(groups, nvme,
                            momentum_in_memory=cfg.zero_optimization.save_muon_momentum_buffer_in_memory)
        return ShardMuon(groups)
    if client is None and cfg.optimizer.type in _OTHERS:
        if nvme is not None:
            raise ConfigError(f"zero_optimization.offload_optimizer.device \"nvme\" streams Adam's states from disk; "
                              f"{cfg.optimizer.type} keeps its states in memory: use device \"cpu\"")
        return _other_optimizer(cfg, shard_groups, requested)
    if client is None:
        overrides = [{k: g[k] for k in GROUP_KEYS if k in g} for g in requested or [{}] * len(shard_groups)]
        options = [{**group_options(cfg), **o} for o in overrides]
        if cfg.optimizer.torch_adam:
            cls = torch.optim.AdamW if options[0]["adamw"] else torch.optim.Adam
            return cls([{"params": g.pieces, **{k: o[k] for k in GROUP_KEYS}} for g, o in zip(shard_groups, options)])
        state_dtype = spec.state_dtype if spec is not None else torch.float32
        seed = rank if spec is not None and spec.stochastic_rounding else None
        if state_dtype == torch.bfloat16 and seed is None and rank == 0:
            _warn_stuck_second_moment(options)
        if nvme is not None:
            return NvmeAdam(shard_groups, options, nvme, rounding_seed=seed)
        return ShardAdam(shard_groups, options, state_dtype=state_dtype, rounding_seed=seed)
    stage = cfg.zero_optimization.stage
    tested = isinstance(client, (torch.optim.Adam, torch.optim.AdamW)) or type(client).__module__.startswith("zkern.")
    if stage >= 1 and not tested and not cfg.zero_allow_untested_optimizer:  # zkern's own (zkern.cpu.CPUAdam): tested
        raise ConfigError(
            f"{type(client).__name__} is an untested ZeRO optimizer: at stage {stage} zkern steps 1-D pieces of "
            f"each rank's shard, which is exact only for element-wise optimizers (Adam, AdamW, SGD, ...). If yours "
            f"is element-wise, add \"zero_allow_untested_optimizer\": true to the config")
    for group, shard in zip(client.param_groups, shard_groups):
        group["params"] = shard.pieces
    return client


def _warn_stuck_second_moment(options: list[dict]) -> None:
    """bf16 moments rounded to nearest: beta2 * v is within half a bf16 unit of v once beta2 > 1 - 2**-9, so v can
    never decrease (it only ratchets up, and the step size with it shrinks). Said once; stochastic rounding keeps
    the decay in expectation."""
    beta2 = max(o["betas"][1] for o in options)
    if beta2 > 1 - 2**-9:
        log.warning("zkern: bf16.bf16_optimizer_states rounds exp_avg_sq to nearest, and beta2 = %g: beta2 * v rounds "
                    "back to v in bf16, so exp_avg_sq never decays (it only grows, and the steps shrink with it). "
                    "Set \"bf16_stochastic_rounding\": true to keep the decay in expectation, or beta2 <= %g",
                    beta2, 1 - 2**-9)


def _check_bf16_state_optimizer(cfg: Config, client) -> None:
    """bf16 optimizer state is zkern's Adam's: a torch optimizer keeps its own state in its parameters' dtype."""
    bf16 = cfg.bf16
    keys = [k for k in ("bf16_optimizer_states", "bf16_master_weights_and_grads") if bf16.enabled and getattr(bf16, k)]
    if not keys:
        return
    other = (f"a client optimizer ({type(client).__name__})" if client is not None else
             f"'optimizer.type' {cfg.optimizer.type}" if cfg.optimizer is not None and cfg.optimizer.type in _OTHERS
             else "'optimizer.params.torch_adam': true" if cfg.optimizer is not None and cfg.optimizer.torch_adam
             else None)
    if other is not None:
        raise ConfigError(f"'bf16.{keys[0]}' keeps the optimizer's state in bf16 inside zkern's fused Adam, and the "
                          f"run steps {other}; use the config's 'optimizer' section with type Adam or AdamW, or "
                          f"remove '{keys[0]}'")


def attach_layout(optimizer: torch.optim.Optimizer, runtime, comm: Comm, stage: int, device: torch.device) -> None:
    """Lamb's norms and Muon's Newton-Schulz are per parameter: tell the optimizer which parameter each shard piece
    belongs to (and where in it), and how to sum over the ranks that hold the other pieces (none at stage 0: every
    rank holds every piece). Muon orthogonalizes on `device`, the training device."""
    if isinstance(optimizer, ShardMuon):
        ranks = Ranks(comm.rank, comm.world,
                      total=lambda t: comm.all_reduce(t, "where Muon's pieces lie", kind="control"),
                      gather=lambda out, inp: comm.all_gather(out, inp, "where Muon's pieces lie", kind="control"),
                      exchange=lambda out, inp, out_splits, inp_splits: comm.all_to_all(
                          out, inp, "Muon's matrices that span ranks, to their owners and back",
                          out_splits=out_splits, inp_splits=inp_splits, kind="muon"))
        smap = runtime.shard_map()
        muon = {j for j, p in enumerate(runtime.params) if p.use_muon}  # every rank's, not only this rank's pieces
        optimizer.device = device
        optimizer.set_layout([[(index, start) for index, start, _ in g] for g in smap.pieces], smap.shapes, muon,
                             ranks if stage > 0 and comm.world > 1 else None)
        if comm.rank == 0:
            names = runtime.names
            log.info("zkern: Muon on %d matrices (%d elements; %d of them in matrices that span ranks, each "
                     "orthogonalized by one owner: all-to-alls each step), AdamW on the other %d parameters: %s",
                     len(muon), sum(smap.shapes[j].numel() for j in muon), optimizer.spanning_numel(),
                     len(names) - len(muon), ", ".join(n for j, n in enumerate(names) if j not in muon) or "none")
        return
    if optimizer is None or not isinstance(optimizer, Lamb):
        return
    owner = [[index for index, _, _ in group] for group in runtime.shard_map().pieces]

    def reduce(sums: torch.Tensor) -> None:  # on the shard's device (nccl on a GPU, gloo on a host)
        comm.all_reduce(sums, "Lamb's per-parameter squared norms", kind="control")

    optimizer.set_layout(owner, len(runtime.params), reduce if stage > 0 and comm.world > 1 else None)


def build_scheduler_for(cfg: Config, client_scheduler, optimizer: torch.optim.Optimizer):
    """The config's WarmupLR/WarmupDecayLR, or the client's scheduler (an object bound to the client optimizer,
    or a callable that takes the engine's optimizer), or None."""
    if client_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("a scheduler is given twice: in the config's 'scheduler' section and as "
                          "Engine(lr_scheduler=...); keep one")
    if cfg.scheduler is not None:
        return build_scheduler(optimizer, cfg.scheduler)
    if client_scheduler is None:
        return None
    if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
        return client_scheduler(optimizer)
    if getattr(client_scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("lr_scheduler is bound to another optimizer than the engine's; build it on the optimizer "
                         "you pass to zkern.Engine, or pass a callable optimizer -> scheduler")
    return client_scheduler


def _inference_groups(model: torch.nn.Module, lr_scheduler, model_parameters, spec: RuntimeSpec) -> list[list]:
    """An engine without an optimizer (forward only): its parameters frozen, nothing only training uses asked of it."""
    model.requires_grad_(False)
    if lr_scheduler is not None:
        raise ConfigError("an lr_scheduler was given but no optimizer (no 'optimizer' section, no optimizer=): an "
                          "engine without an optimizer runs forward only")
    if model_parameters is not None:
        log.info("zkern: model_parameters are the config optimizer's groups; this engine has no optimizer, so they "
                 "choose nothing")
    if spec.offload_optimizer != "none":
        log.info("zkern: offload_optimizer has nothing to move: this engine has no optimizer")
    return [[]]


def checked_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, model_parameters,
                   spec: RuntimeSpec, *, lr_scheduler=None, inference: bool = False, muon: bool = False,
                   ) -> tuple[list[list[torch.nn.Parameter]], list[dict] | None]:
    """The trainable parameters per optimizer group (the client optimizer's groups, the requested model_parameters
    groups, or one group), and the requested groups; ValueError for what cannot train as asked. inference: no
    optimizer anywhere (every parameter frozen, one empty group). muon: the config's Muon, each group split into its
    Muon and AdamW halves."""
    if inference:
        return _inference_groups(model, lr_scheduler, model_parameters, spec), None
    if optimizer is not None and type(optimizer).__name__ in ("Muon", "MuonWithAuxAdam"):
        raise ConfigError(f"{type(optimizer).__name__} was passed as the optimizer: zkern steps flat shard pieces, and "
                          f"Muon needs whole matrices; put \"optimizer\": {{\"type\": \"Muon\", \"params\": {{...}}}} "
                          f"in the config instead (zkern's Muon assembles each matrix across ranks)")
    if model_parameters is not None and optimizer is not None:  # DeepSpeed ignores them beside a client optimizer
        log.warning("zkern: model_parameters are the config optimizer's groups; beside an optimizer= they choose "
                    "nothing (the optimizer's own groups decide, as under DeepSpeed)")
        model_parameters = None
    requested = requested_groups(model_parameters) if model_parameters is not None else None
    groups = trainable_groups(model, optimizer, requested)
    if not any(groups):
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    if spec.dtype == torch.float32:
        check_dtypes(groups, model)
    if not spec.zero.contiguous_gradients:
        log.warning("zkern: zero_optimization.contiguous_gradients=false has no effect: zkern always reduces "
                    "gradients from contiguous buckets, which costs no extra memory")
    if spec.stage != 3 and any(is_sharded(p) for p in model.parameters()):
        raise ValueError("the model was built under zkern.init_sharded, which partitions it for ZeRO stage 3; "
                         f"the config says stage {spec.stage}: use stage 3, or build the model without it")
    if muon:
        return muon_groups.split(model, groups, requested)
    return groups, requested


def make_runtime(model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], spec: RuntimeSpec, cfg: Config, *,
                 comm: Comm, store: ShardStore) -> Runtime:
    """The stage runtime: it builds its buffers on the device from the parameters where they are (the host,
    typically), a bucket or a unit at a time, from the fp32 values."""
    if spec.stage == 3:
        param_files = None
        if spec.offload_param == "nvme":  # stage 3's working shard in a file under offload_param.nvme_path
            def param_files(numel, dtype, units):
                return nvme.params_from_config(cfg, comm.rank, numel, dtype, units)
        return Stage3Runtime(model, groups, spec, comm=comm, store=store, param_files=param_files)
    return Stage12Runtime(model, groups, param_names(model), spec, comm=comm, store=store,
                          quantized=QuantizedReduce.from_config(comm, spec.zero))
