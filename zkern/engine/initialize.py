"""zkern.initialize: deepspeed.initialize's signature and return, for scripts written against it.

    engine, optimizer, dataloader, lr_scheduler = zkern.initialize(model=model, config="ds_config.json",
                                                                   training_data=dataset)
"""

from __future__ import annotations

import os

import torch

from zkern.config import Config
from zkern.engine.engine import Engine


def initialize(model: torch.nn.Module | None = None, model_parameters=None,
               config: Config | dict | str | os.PathLike | None = None, optimizer=None, lr_scheduler=None,
               training_data=None, collate_fn=None, *, args=None):
    """Build an Engine and return (engine, optimizer, dataloader, lr_scheduler) as deepspeed.initialize does.

    model_parameters: the parameters or param-group dicts the config's optimizer trains (default: every parameter
    that requires grad). optimizer: a torch optimizer over the model's parameters, or a callable that takes
    model_parameters (or model.parameters()) and returns one; only when the config has no 'optimizer' section.
    lr_scheduler: a scheduler bound to that optimizer, or a callable optimizer -> scheduler. training_data: a
    torch Dataset; the dataloader then reads it through a DistributedSampler (this rank's share, reshuffled per
    epoch by sampler.set_epoch) in micro-batches of train_micro_batch_size_per_gpu, with collate_fn; without it the
    dataloader is None. args: an argparse namespace whose deepspeed_config (or zkern_config) names the config
    when config is None, as DeepSpeed's launcher scripts pass it.
    """
    if model is None:
        raise ValueError("zkern.initialize needs model=, the torch.nn.Module to train")
    if config is None:
        config = getattr(args, "zkern_config", None) or getattr(args, "deepspeed_config", None)
        if config is None:
            raise ValueError("zkern.initialize needs config=: a dict, a path to a DeepSpeed-style JSON, or a "
                             "zkern.Config (or args with a deepspeed_config path)")
    if optimizer is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
        model_parameters = None  # they went into the client optimizer
    engine = Engine(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler, model_parameters=model_parameters)
    dataloader = None
    if training_data is not None:
        from zkern.engine.engine_state import dataloader_component

        dataloader = training_dataloader(training_data, engine, collate_fn)
        engine.state.add(dataloader_component(dataloader.sampler))  # its epoch is saved with the counters
    return engine, engine.optimizer, dataloader, engine.lr_scheduler


def training_dataloader(dataset, engine: Engine, collate_fn=None) -> torch.utils.data.DataLoader:
    """A DataLoader over this rank's share of dataset (DistributedSampler, shuffled, seeded alike on every rank) in
    micro-batches of the config's train_micro_batch_size_per_gpu."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError("training_data is an IterableDataset, which a DistributedSampler cannot split; give each "
                        "rank its own stream and build the DataLoader yourself")
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"training_data must be a map-style torch Dataset (with __len__ and __getitem__), got "
                        f"{type(dataset).__name__}")
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=engine.world_size,
                                                              rank=engine.rank, shuffle=True)
    return torch.utils.data.DataLoader(dataset, batch_size=engine.config.train_micro_batch_size_per_gpu,
                                       sampler=sampler, collate_fn=collate_fn,
                                       drop_last=engine.config.dataloader_drop_last)
