"""The planted bugs of ZeRO-Offload and ZeRO-Infinity (planted.py's catalogue names them): the host step's
uploads, the delayed update, the staging ring and its sharing, stage 3's uploads ahead of use, the speculative step,
the NVMe optimizer. Each takes planted.py's patch set and patches module attributes through it.
"""

from __future__ import annotations


# -- offload -------------------------------------------------------------------------------------------------------
def offload_not_uploaded(p) -> None:
    """ZeRO-Offload: the host step's updated parameters never go back up."""
    from zkern.offload.host import HostStep

    p.set(HostStep, "_up", lambda self, gi, ci: None)


def delay_lands_at_once(p) -> None:
    """The delayed update's weights go up as soon as its Adam ends, before the next step's forward (no delay)."""
    from zkern.offload.host import HostStep

    def make(original):
        def launch(self, optimizer, grad_scale, active, **kw):
            original(self, optimizer, grad_scale, active, **kw)
            self.land()
        return launch
    p.wrap(HostStep, "_launch", make)


def ring_reused_early(p) -> None:
    """The staging ring's next chunk comes down into a buffer before the chunk there has had its parameters sent up
    (which then go up as the next chunk's gradient)."""
    from zkern.offload.host import HostStep

    def up_and_next(self, gi, ci):
        later = self._position[(gi, ci)] + len(self.ring)
        if later < len(self._order):
            self._timed_down(self._order[later])
        self._up(gi, ci)
    p.set(HostStep, "_up_and_next", up_and_next)


def upload_unwaited(p) -> None:
    """Stage 3's offload_param: a prefetched unit is used without waiting for its upload (on a GPU, the side
    stream's copy races the compute that reads the unit; on a CPU the deferred copy never lands)."""
    from zkern.stage3.uploads import Uploads

    p.set(Uploads, "wait", lambda self, unit: self.pending.pop(unit, None) and None)


def speculation_kept_when_clipped(p) -> None:
    """The speculative step's verdict forgets the clipping check: an unclipped update stands where clipping bit."""
    from zkern.offload.speculative import SpeculativeStep

    def make(original):
        def verdict(self, grad_scale, active, optimizer):
            return original(self, self._guess["grad_scale"] if self._guess else grad_scale, active, optimizer)
        return verdict
    p.wrap(SpeculativeStep, "verdict", make)


def staging_takes_working_copies(p) -> None:
    """A weight set rewrites every working copy from the masters, the host staging that holds the gradients copied
    down in the backward before it included."""
    from zkern.engine import param_views

    p.set(param_views, "shares_staging", lambda chunk: False)


def nvme_last_tile_skipped(p) -> None:
    """ZeRO-Infinity: the NVMe optimizer skips the last piece of work of every tile."""
    from zkern.offload.nvme import NvmeAdam

    def make(original):
        def step_tile(self, tile, buffers, work, grad_scale):
            return original(self, tile, buffers, list(work)[:-1], grad_scale)
        return step_tile
    p.wrap(NvmeAdam, "_step_tile", make)


def speculation_guess_in_place(p) -> None:
    """The speculative step's guessed parameters are written where the model reads them (stage 3's host parameter
    shard; on a CPU engine, the parameter shard of any stage), not to staging that waits for the decision: a skipped
    or clipped step leaves the guess there."""
    from zkern.offload.host import HostStep

    def make(original):
        def init(self, device_groups, **kw):
            original(self, device_groups, **kw)
            if self.speculative:
                for host, dev in zip(self.host_groups, device_groups):
                    for h, d in zip(host.chunks, dev.chunks):
                        if d.out is not None and not self.store.in_files(d.out) and d.out.device.type == "cpu":
                            h.out = d.out
        return init
    p.wrap(HostStep, "__init__", make)


def export_one_behind(p) -> None:
    """The exports read the forward's weights, which trail the trained model by the delayed update in flight."""
    import contextlib

    from zkern.offload.store import ShardStore

    def landed_view(self):
        self.settle()
        return contextlib.nullcontext()
    p.set(ShardStore, "landed_view", landed_view)


def save_lands_update(p) -> None:
    """A save (and every read that settles the host step) lands the delayed update in flight early."""
    from zkern.offload.store import ShardStore

    p.set(ShardStore, "settle", lambda self: self.land_update())


def write_compared_with_stale(p) -> None:
    """A GatheredParameters context that may write shows the weights before the delayed update in flight, so an
    element written with the value it held before the update counts as unchanged and keeps the update's value."""
    import contextlib

    from zkern.offload.store import ShardStore

    p.set(ShardStore, "trained_view", lambda self, modifier_rank: contextlib.ExitStack())


def device_part_unstepped(p) -> None:
    """Partial offload's device part is left out of the step's order: its chunks never step."""
    from zkern.offload.host import HostStep

    def make(original):
        def init(self, device_groups, **kw):
            original(self, device_groups, **kw)
            self.device_keys = []
        return init
    p.wrap(HostStep, "__init__", make)


def nvme_muon_momentum_unwritten(p) -> None:
    """Muon on NVMe: each piece's stepped momentum is never written back to its file (every step starts again from
    the momentum the file held)."""
    from zkern.offload.nvme_muon import NvmeMuon

    def make(original):
        def store(self, gi, k, piece, name, values):
            if name != "momentum_buffer":
                original(self, gi, k, piece, name, values)
        return store
    p.wrap(NvmeMuon, "_store", make)
