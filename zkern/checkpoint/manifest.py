"""A checkpoint's directory layout, its manifest (JSON, self-checked) and the `latest` pointer; no torch.

    python -m zkern.checkpoint inspect CKPT_DIR

    CKPT_DIR/latest                       the newest complete tag (text), replaced by rename
    CKPT_DIR/<tag>/manifest.json          everything but tensors, plus each file's header's and each tensor's sha256
    CKPT_DIR/<tag>/rank00000.safetensors  what rank 0 held: ranges of parameters and optimizer states, RNG
    CKPT_DIR/.tmp-<tag>-<nonce>/          a save in progress (renamed to <tag> when complete; never read)

A tensor entry is one contiguous range of one tensor of model.state_dict(), flattened: (kind, name, start, numel)
in the manifest, stored under the key "kind:name:start" in a rank's file. kinds: "master" (fp32 weights of a
trained parameter), "optim.<state>" (an optimizer state shaped like its parameter, e.g. optim.exp_avg), "module"
(frozen parameters and buffers, in their own dtype), "loco.<bucket>" (a rank's LoCo error buffer, name "rank<r>"),
"working" (with "pending_update": a delayed update was stepped and not landed when the save ran; the weights the
forward computed with then, in the working dtype, beside masters that hold the update).
Nothing here depends on the world size or stage that wrote it.

Version 3 keeps every state component's saved form (core/state.py) as plain data: "state" maps a component's name
to rank 0's form (counters, loss scaler, LR scheduler, data-loader epoch), "rank_state" maps "rank<r>" to that
rank's own forms (its generators). Versions 1 and 2 (still read) held the counters, scaler, scheduler and epoch as
fields of their own and the torch generators as tensor entries "rng.cpu" / "rng.cuda" (name "rank<r>"); the load
reads them into the same forms (load.py). Version 2 checksums a file as its header's sha256 plus its tensors'
(which tile the rest): a save hashes every byte once. Version 1 also held the whole file's sha256, which cost a
second hash of every byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

from zkern.checkpoint.tensorfile import DTYPE_SIZES
from zkern.errors import CheckpointError
from zkern.safe_io import parse_json, read_capped

FORMAT = "zkern-checkpoint"
VERSION = 3
READ_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"  # a tag being replaced by a save of the same tag, for the moment between two renames
_RANK_FILE = re.compile(r"rank\d{5}\.safetensors")
_TAG = re.compile(r"[A-Za-z0-9_.+=-]{1,200}")
MAX_MANIFEST = 1 << 30


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def entry_key(kind: str, name: str, start: int) -> str:
    return f"{kind}:{name}:{start}"


def check_tag(tag: str) -> str:
    """A tag names a directory beside others: letters, digits and _ . + = - only (no path separators)."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag in (".", "..") or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} is not usable as a directory name: use letters, digits and "
                              f"_ . + = - (not starting with '.'), e.g. 'global_step100'")
    return tag


def check_plain(value, where: str) -> None:
    """Raise unless value is plain JSON data: None, bool, int, finite float, str, list, dict with str keys. A
    tuple would come back a list and an int key a str, so they are refused rather than silently changed."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"{where} is {value}, which JSON cannot hold exactly")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where} has the key {k!r} ({type(k).__name__}): checkpoint data is stored as "
                                      f"JSON, whose keys are strings; use str keys")
            check_plain(v, f"{where}[{k!r}]")
        return
    hint = " (use a list)" if isinstance(value, tuple) else \
        " (store tensors with engine.save_checkpoint's own state, or convert with .tolist())" \
        if type(value).__name__ in ("Tensor", "Parameter", "ndarray") else ""
    raise CheckpointError(f"{where} is a {type(value).__name__}, which a checkpoint cannot store: it keeps only "
                          f"plain JSON data (None, bool, int, float, str, list, dict with str keys), so that loading "
                          f"one never runs code{hint}")


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_bytes(body: dict) -> bytes:
    return json.dumps({"sha256": _digest(body), "manifest": body}, indent=1, sort_keys=True).encode()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(tag_dir: str) -> dict:
    """The manifest of one tag, its checksum and structure verified."""
    path = os.path.join(tag_dir, MANIFEST)
    try:
        raw = read_capped(path, MAX_MANIFEST, "manifest")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the directory is not a complete zkern checkpoint)") from None
    outer = parse_json(raw, path, "manifest")
    if not isinstance(outer, dict) or not isinstance(outer.get("manifest"), dict) \
            or not isinstance(outer.get("sha256"), str):
        raise CheckpointError(f"{path}: not a zkern manifest (no 'manifest' object and 'sha256' string); the file is "
                              f"damaged or was not written by zkern")
    body, stored = outer["manifest"], outer["sha256"]
    if not isinstance(body, dict) or _digest(body) != stored:
        raise CheckpointError(f"{path}: its sha256 does not match its content (stored {stored}, computed "
                              f"{_digest(body) if isinstance(body, dict) else 'n/a'}): the manifest was altered")
    _validate(body, path)
    return body


def _validate(body: dict, path: str) -> None:
    def need(obj, key, kind, where):
        if not isinstance(obj, dict) or not isinstance(obj.get(key), kind):
            raise CheckpointError(f"{path}: {where}{key!r} is missing or not a {getattr(kind, '__name__', kind)}")
        return obj[key]

    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {body.get('format')!r}, expected {FORMAT!r}")
    if body.get("version") not in READ_VERSIONS:
        raise CheckpointError(f"{path}: format version {body.get('version')!r}; this zkern reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))} (a newer zkern wrote it: upgrade zkern)")
    for key in ("world_size", "stage"):
        need(body, key, int, "")
    need(body, "precision", str, "")
    if "client_state" not in body:  # its value may be null; its absence would fail after the weights were applied
        raise CheckpointError(f"{path}: 'client_state' is missing")
    need(body, "excluded_frozen", bool, "")
    if not isinstance(body.get("pending_update", False), bool):  # absent before the delayed update saved its own
        raise CheckpointError(f"{path}: 'pending_update' is not true or false")
    aliases = need(body, "aliases", dict, "")
    if not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"{path}: 'aliases' maps names to something other than names")
    if body["version"] >= 3:  # each form is checked by its component when a load takes it
        need(body, "state", dict, "")
        if not all(isinstance(forms, dict) for forms in need(body, "rank_state", dict, "").values()):
            raise CheckpointError(f"{path}: 'rank_state' holds something other than objects")
    else:
        _validate_version_2_state(body, path, need)
    optimizer = need(body, "optimizer", dict, "")
    need(optimizer, "type", str, "optimizer.")
    if not all(isinstance(g, dict) for g in need(optimizer, "param_groups", list, "optimizer.")):
        raise CheckpointError(f"{path}: optimizer.param_groups holds something other than objects")
    for name, values in need(optimizer, "scalars", dict, "optimizer.").items():
        if not isinstance(values, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in values.values()):
            raise CheckpointError(f"{path}: optimizer.scalars[{name!r}] is not an object of numbers")
    for key, dtype in need(optimizer, "scalar_types", dict, "optimizer.").items():
        if dtype is not None and dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: optimizer.scalar_types[{key!r}] is {dtype!r}, not a dtype")
    files = need(body, "files", dict, "")
    for name, info in files.items():
        if not _RANK_FILE.fullmatch(name):
            raise CheckpointError(f"{path}: lists the file {name!r}, which is not a rank file name; refusing to "
                                  f"read outside the checkpoint")
        need(info, "bytes", int, f"files[{name!r}].")
        need(info, "sha256" if body["version"] == 1 else "header_sha256", str, f"files[{name!r}].")
    for key in ("params", "module"):
        for name, info in need(body, key, dict, "").items():
            shape = need(info, "shape", list, f"{key}[{name!r}].")
            if not all(isinstance(s, int) and s >= 0 for s in shape):
                raise CheckpointError(f"{path}: {key}[{name!r}] has shape {shape}: not a shape")
    for i, e in enumerate(need(body, "tensors", list, "")):
        where = f"tensors[{i}]."
        for key, kind in (("file", str), ("kind", str), ("name", str), ("start", int), ("numel", int),
                          ("dtype", str), ("sha256", str)):
            need(e, key, kind, where)
        if e["file"] not in files or e["dtype"] not in DTYPE_SIZES or e["start"] < 0 or e["numel"] < 0:
            raise CheckpointError(f"{path}: tensor entry {e.get('kind')}:{e.get('name')} names file {e['file']!r} "
                                  f"/ dtype {e['dtype']!r} / range start {e['start']} numel {e['numel']}: not valid")


def _validate_version_2_state(body: dict, path: str, need) -> None:
    """Versions 1-2: the counters, loss scaler and scheduler as fields of their own."""
    for key in ("global_steps", "skipped_steps", "micro_steps"):
        need(body, key, int, "")
    if not isinstance(body.get("loss_scaled", False), bool):
        raise CheckpointError(f"{path}: 'loss_scaled' is not true or false")
    scaler = need(body, "loss_scaler", dict, "")
    for key, kind in (("scale", (int, float)), ("hysteresis_left", int), ("iter", int), ("last_overflow_iter", int)):
        if not isinstance(scaler.get(key), kind) or isinstance(scaler.get(key), bool):
            raise CheckpointError(f"{path}: loss_scaler[{key!r}] is missing or not a number")
    if body.get("lr_scheduler") is not None and not isinstance(body["lr_scheduler"], dict):
        raise CheckpointError(f"{path}: 'lr_scheduler' is neither null nor an object")


def rank_forms(body: dict, rank: int) -> dict | None:
    """Rank `rank`'s own saved forms (component name -> form: its generators) from a version-3 manifest; None where
    the checkpoint holds none for that rank (saved by fewer ranks) or is of versions 1-2 (their generators are
    tensor entries of the rank files, which the load reads)."""
    if body["version"] < 3:
        return None
    return body["rank_state"].get(f"rank{rank}")


def saved_state(body: dict) -> dict:
    """rank 0's saved forms by component name (core/state.py), from a manifest of any version: version 3 holds
    them; versions 1-2 held the same values as fields of their own (their generators are tensor entries, which
    the load reads per rank)."""
    if body["version"] >= 3:
        return body["state"]
    norm = body.get("last_grad_norm")
    if isinstance(norm, bool) or not isinstance(norm, (int, float)):
        norm = None  # as those versions' loads read anything but a number
    elif not math.isfinite(norm):
        norm = str(float(norm))  # inf after an overflow: the counters' text form
    state = {"counters": {"global_steps": body["global_steps"], "skipped_steps": body["skipped_steps"],
                          "micro_steps": body["micro_steps"], "last_grad_norm": norm},
             # older manifests said only the precision; fp16 scaled its loss
             "loss_scaler": {"loss_scaled": body.get("loss_scaled", body["precision"] == "fp16"),
                             "state": body["loss_scaler"]}}
    if body.get("lr_scheduler") is not None:
        state["lr_scheduler"] = {"type": body.get("lr_scheduler_type") or "scheduler", "state": body["lr_scheduler"]}
    if isinstance(body.get("dataloader"), dict):
        state["dataloader"] = body["dataloader"]
    return state


def read_latest(ckpt_dir: str) -> str | None:
    path = os.path.join(ckpt_dir, LATEST)
    try:
        raw = read_capped(path, 4096, "'latest' file")
    except FileNotFoundError:
        return None
    try:
        return check_tag(raw.decode().strip())
    except (UnicodeDecodeError, CheckpointError):
        raise CheckpointError(f"{path}: does not hold a tag name ({raw[:80]!r}): the file is damaged") from None


def write_latest(ckpt_dir: str, tag: str) -> None:
    """Point `latest` at tag by writing a temporary file and renaming it over the old one (atomic)."""
    tmp = os.path.join(ckpt_dir, f".{LATEST}.tmp")
    write_file_durably(tmp, tag.encode())
    os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    fsync_dir(ckpt_dir)


def tag_dir(ckpt_dir: str, tag: str) -> str | None:
    """The directory holding tag's complete checkpoint: <tag>, or, if a save of the same tag was killed between
    moving the old one aside and renaming the new one in, the old one; None when neither exists."""
    path = os.path.join(ckpt_dir, check_tag(tag))
    if os.path.isdir(path):
        return path
    aside = sorted(n for n in os.listdir(ckpt_dir) if aside_tag(n) == tag) if os.path.isdir(ckpt_dir) else []
    return os.path.join(ckpt_dir, aside[-1]) if aside else None


def aside_tag(name: str) -> str | None:
    """The tag a moved-aside directory ".old-<tag>-<nonce>" holds (the nonce has no '-'; a tag may), else None:
    ".old-a-b-x1" is tag "a-b"'s, never tag "a"'s."""
    if not name.startswith(OLD_PREFIX) or "-" not in name[len(OLD_PREFIX):]:
        return None
    return name[len(OLD_PREFIX):].rsplit("-", 1)[0]


def list_tags(ckpt_dir: str) -> list[str]:
    """Tags with a manifest, oldest first (by the manifest's time)."""
    tags = []
    for name in os.listdir(ckpt_dir):
        if not name.startswith(".") and os.path.isfile(os.path.join(ckpt_dir, name, MANIFEST)):
            tags.append((os.path.getmtime(os.path.join(ckpt_dir, name, MANIFEST)), name))
    return [name for _, name in sorted(tags)]


def check_sizes(manifest: dict, path: str) -> None:
    """Every entry's range lies inside its tensor's shape (a manifest cannot make a loader allocate more than
    the model it describes)."""
    numels = {}
    for table in ("params", "module"):
        for name, info in manifest[table].items():
            n = 1
            for s in info["shape"]:
                n *= s
            numels[name] = n
    for e in manifest["tensors"]:
        if e["kind"].startswith("rng."):
            if e["numel"] > 1 << 20 or e["dtype"] != "U8":
                raise CheckpointError(f"{path}: generator state {e['name']} is {e['dtype']} x {e['numel']}: not one")
            continue
        if e["kind"].startswith("loco."):  # a rank's LoCo error buffer, as large as its gradient bucket
            if not re.fullmatch(r"rank\d+", e["name"]) or e["dtype"] not in ("F32", "F16", "BF16"):
                raise CheckpointError(f"{path}: LoCo entry {e['kind']}:{e['name']} ({e['dtype']}) is not one")
            continue
        n = numels.get(e["name"])
        if n is None or e["start"] + e["numel"] > n:
            raise CheckpointError(f"{path}: tensor entry {e['kind']}:{e['name']} covers elements "
                                  f"[{e['start']}, {e['start'] + e['numel']}) of a tensor of "
                                  f"{'unknown size' if n is None else f'{n} elements'}: the manifest is damaged")
        if DTYPE_SIZES.get(e["dtype"]) is None:
            raise CheckpointError(f"{path}: tensor entry {e['kind']}:{e['name']} has dtype {e['dtype']!r}")
