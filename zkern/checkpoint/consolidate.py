"""Whole tensors out of a checkpoint: streaming consolidation into HF-loadable safetensors, load_fp32_state_dict,
load_optimizer_state_dict, and inspect.

    python -m zkern.checkpoint consolidate CKPT_DIR OUT_DIR [--tag T] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
    python -m zkern.checkpoint inspect CKPT_DIR

consolidate never holds a tensor whole: it writes each output file's header from the manifest, then copies every
entry's bytes from the rank files to the output in blocks of COPY_BLOCK bytes, hashing them on the way (each entry's
sha256 is checked when its last block has passed; a mismatch deletes the partial output). Peak memory is one block
(two when converting dtypes) beside the interpreter. fp32 to fp32 moves bytes only and imports no torch; a dtype
change converts each block with torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from zkern.checkpoint.manifest import (
    MANIFEST,
    check_sizes,
    entry_key,
    list_tags,
    read_latest,
    read_manifest,
    saved_state,
    tag_dir,
)
from zkern.checkpoint.tensorfile import COPY_BLOCK, DTYPE_SIZES, StreamWriter, file_sha256, read_header
from zkern.errors import CheckpointError

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
OUT_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def open_tag(ckpt_dir, tag=None) -> tuple[str, dict]:
    """(the tag's directory, its verified manifest); tag None: the one `latest` names."""
    ckpt_dir = os.fspath(ckpt_dir)
    wanted = tag if tag is not None else read_latest(ckpt_dir)
    if wanted is None:
        raise CheckpointError(f"{ckpt_dir!r} has no 'latest' file: pass tag= (tags there: "
                              f"{list_tags(ckpt_dir) if os.path.isdir(ckpt_dir) else 'none, no such directory'})")
    path = tag_dir(ckpt_dir, str(wanted))
    if path is None:
        raise CheckpointError(f"no checkpoint tagged {wanted!r} in {ckpt_dir!r}")
    manifest = read_manifest(path)
    check_sizes(manifest, os.path.join(path, MANIFEST))
    _check_backed(path, manifest)
    return path, manifest


def _check_backed(path: str, manifest: dict) -> None:
    """Every file is there at the manifest's size and holds at least the bytes its entries claim, so whatever is
    allocated from entries that tile a tensor is backed by bytes on disk (a manifest cannot ask for a 10 TB
    buffer)."""
    claimed: dict[str, int] = {}
    for e in manifest["tensors"]:
        claimed[e["file"]] = claimed.get(e["file"], 0) + e["numel"] * DTYPE_SIZES[e["dtype"]]
    for name, info in manifest["files"].items():
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.exists(file) else None
        if size != info["bytes"]:
            short = " (truncated)" if size is not None and size < info["bytes"] else ""
            raise CheckpointError(f"{file}: {'missing' if size is None else f'{size} bytes'}, the manifest says "
                                  f"{info['bytes']} bytes{short}")
        if claimed.get(name, 0) > size:
            raise CheckpointError(f"{file}: the manifest places {claimed[name]} bytes of tensors in a {size}-byte "
                                  f"file: the manifest is damaged")


def _whole_tensors(manifest: dict) -> list[tuple[str, str, str, list[int], str]]:
    """(output name, source kind, source name, shape, stored dtype) for every tensor of model.state_dict() the
    checkpoint holds, in its order (tied names each get the shared values)."""
    out = []
    for name in manifest["order"]:
        source = manifest["aliases"].get(name, name)
        if source in manifest["params"]:
            out.append((name, "master", source, manifest["params"][source]["shape"], "F32"))
        elif source in manifest["module"]:
            info = manifest["module"][source]
            out.append((name, "module", source, info["shape"], info["dtype"]))
    return out


def _ranges(manifest: dict, kind: str, name: str, numel: int, where: str) -> list[dict]:
    """The entries of (kind, name), which must tile [0, numel) exactly (a range stored twice, as node-local storage
    does, is read once)."""
    entries = sorted((e for e in manifest["tensors"] if e["kind"] == kind and e["name"] == name),
                     key=lambda e: e["start"])
    unique: dict[tuple[int, int], dict] = {}
    for e in entries:
        unique.setdefault((e["start"], e["numel"]), e)
    entries = list(unique.values())
    at = 0
    for e in entries:
        if e["start"] != at:
            raise CheckpointError(f"{where}: {kind} values of {name!r} are missing or overlap at element {at} "
                                  f"(next entry starts at {e['start']})")
        at += e["numel"]
    if at != numel:
        raise CheckpointError(f"{where}: {kind} values of {name!r} cover {at} of its {numel} elements")
    return entries


def parse_size(text) -> int:
    """'5GB' -> 5e9 bytes (Hugging Face's decimal units), '500MiB' -> 500 * 2^20, an int as is."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 1000000 (bytes)")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * base ** power)


def consolidate(ckpt_dir, out_dir, tag=None, dtype: str = "fp32", max_shard_size=None) -> list[str]:
    """Write the checkpoint's weights (fp32 masters, frozen parameters and buffers) as model.safetensors, or as
    model-0000k-of-0000n.safetensors shards plus model.safetensors.index.json when they exceed max_shard_size.
    Floating tensors are written in `dtype`. Returns the files written."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(OUT_DTYPES)}")
    path, manifest = open_tag(ckpt_dir, tag)
    where = os.path.join(path, MANIFEST)
    target = OUT_DTYPES[dtype]
    tensors = []
    for name, kind, source, shape, stored in _whole_tensors(manifest):
        numel = 1
        for s in shape:
            numel *= s
        out_dtype = target if stored in FLOAT_DTYPES else stored
        tensors.append((name, kind, source, shape, stored, out_dtype, _ranges(manifest, kind, source, numel, where)))
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[list[tuple]] = [[]]
    size = 0
    for t in tensors:
        nbytes = DTYPE_SIZES[t[5]] * sum(e["numel"] for e in t[6])
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    copier = _Copier(path, manifest)
    written = []
    try:
        for file_name, shard in zip(names, shards):
            final = os.path.join(out_dir, file_name)
            tmp = final + ".partial"
            writer = StreamWriter(tmp, [(t[0], t[5], tuple(t[3])) for t in shard], {"format": "pt"},
                                  hashed=False)  # the input's checksums are checked; the output needs none
            try:
                for t in shard:
                    writer.begin(t[0])
                    for e in t[6]:
                        copier.copy(e, writer, t[5])
                writer.close(fsync=True)
            except BaseException:
                writer.abort()
                os.unlink(tmp)
                raise
            os.replace(tmp, final)
            written.append(final)
        if len(shards) > 1:
            total = sum(DTYPE_SIZES[t[5]] * sum(e["numel"] for e in t[6]) for shard in shards for t in shard)
            index = {"metadata": {"total_size": total},
                     "weight_map": {t[0]: file_name for file_name, shard in zip(names, shards) for t in shard}}
            index_path = os.path.join(out_dir, "model.safetensors.index.json")
            with open(index_path, "w") as f:
                json.dump(index, f, indent=2)
            written.append(index_path)
    finally:
        copier.close()
    return written


class _Copier:
    """Streams entries from rank files into an output writer, verifying sizes, headers and checksums."""

    def __init__(self, tag_path: str, manifest: dict):
        self.tag_path, self.manifest = tag_path, manifest
        self.files: dict[str, tuple] = {}

    def _open(self, file: str):
        if file not in self.files:  # open_tag has checked its size against the manifest (_check_backed)
            path = os.path.join(self.tag_path, file)
            self.files[file] = (open(path, "rb"), read_header(path)[0], path)  # noqa: SIM115 - closed in close()
        return self.files[file]

    def copy(self, e: dict, writer: StreamWriter, out_dtype: str) -> None:
        f, header, path = self._open(e["file"])
        key = entry_key(e["kind"], e["name"], e["start"])
        info = header.get(key)
        if info is None or info.dtype != e["dtype"] or info.numel != e["numel"]:
            raise CheckpointError(f"{path}: tensor {key!r} is missing or differs from the manifest's "
                                  f"{e['dtype']} x {e['numel']}")
        digest = hashlib.sha256()
        f.seek(info.begin)
        left = info.end - info.begin
        while left:
            block = f.read(min(COPY_BLOCK, left))
            if not block:
                raise CheckpointError(f"{path}: tensor {key!r} ends early (truncated)")
            digest.update(block)
            writer.write(block if out_dtype == e["dtype"] else _convert(block, e["dtype"], out_dtype))
            left -= len(block)
        if digest.hexdigest() != e["sha256"]:
            raise CheckpointError(f"{path}: tensor {key!r}: sha256 {digest.hexdigest()} differs from the "
                                  f"manifest's {e['sha256']}: the file was altered or damaged")

    def close(self) -> None:
        for f, _, _ in self.files.values():
            f.close()


def _convert(block: bytes, src: str, dst: str) -> memoryview:
    import torch

    from zkern.checkpoint.ranges import TORCH_DTYPES, byte_view

    t = torch.frombuffer(bytearray(block), dtype=TORCH_DTYPES[src]).to(TORCH_DTYPES[dst])
    return memoryview(bytes(byte_view(t)))


def load_fp32_state_dict(ckpt_dir, tag=None) -> dict:
    """{name: fp32 tensor (its own dtype when not floating)} of model.state_dict(); tied names share one tensor."""
    import torch

    from zkern.checkpoint.ranges import TORCH_DTYPES, RangeReader

    path, manifest = open_tag(ckpt_dir, tag)
    reader = RangeReader(path, manifest)
    out, shared = {}, {}
    for _, kind, source, shape, _ in _whole_tensors(manifest):  # every tensor tiled by entries before allocating
        _ranges(manifest, kind, source, _numel(shape), path)
    for name, kind, source, shape, stored in _whole_tensors(manifest):
        if (kind, source) not in shared:
            dtype = torch.float32 if stored in FLOAT_DTYPES else TORCH_DTYPES[stored]
            t = torch.empty(shape, dtype=dtype)
            reader.request(kind, source, 0, t.view(-1))
            shared[(kind, source)] = t
        out[name] = shared[(kind, source)]
    reader.check_files()
    reader.run()
    return out


def load_optimizer_state_dict(ckpt_dir, tag=None) -> dict:
    """{parameter name: {"exp_avg": tensor, ..., "step": n}}: whole per-element states, and scalars."""
    import torch

    from zkern.checkpoint.ranges import RangeReader

    path, manifest = open_tag(ckpt_dir, tag)
    reader = RangeReader(path, manifest)
    out: dict = {}
    for name, info in manifest["params"].items():
        state = out.setdefault(name, {})
        for kind in sorted(k for k in reader.kinds_of.get(name, ()) if k.startswith("optim.")):
            _ranges(manifest, kind, name, _numel(info["shape"]), path)
            t = torch.empty(info["shape"], dtype=torch.float32)
            reader.request(kind, name, 0, t.view(-1))
            state[kind[len("optim."):]] = t
        state.update(manifest["optimizer"]["scalars"].get(name, {}))
    reader.check_files()
    reader.run()
    return out


def inspect(ckpt_dir, verify: bool = True) -> list[str]:
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir!r} is not a directory")
    try:
        latest = read_latest(ckpt_dir)
    except CheckpointError as e:
        latest = f"UNREADABLE: {e}"
    lines = [f"{ckpt_dir}: latest -> {latest}"]
    for tag in list_tags(ckpt_dir):
        path = os.path.join(ckpt_dir, tag)
        try:
            m = read_manifest(path)
        except CheckpointError as e:
            lines.append(f"  {tag}: UNREADABLE: {e}")
            continue
        total = sum(f["bytes"] for f in m["files"].values())
        params = sum(_numel(i["shape"]) for i in m["params"].values())
        counters = saved_state(m).get("counters")
        step, skipped = (counters.get("global_steps"), counters.get("skipped_steps")) \
            if isinstance(counters, dict) else ("?", "?")
        lines.append(f"  {tag}: step {step} (skipped {skipped}), world {m['world_size']}, "
                     f"stage {m['stage']}, {m['precision']}, offload optimizer={m['offload_optimizer']} "
                     f"param={m['offload_param']}; {len(m['params'])} trained tensors ({params:,} elements), "
                     f"{len(m['module'])} other; {len(m['files'])} files, {total / 2**20:.1f} MiB")
        if verify:
            bad = []
            for name, info in sorted(m["files"].items()):
                file = os.path.join(path, name)
                if not os.path.exists(file):
                    bad.append(f"{name} missing")
                elif os.path.getsize(file) != info["bytes"]:
                    bad.append(f"{name} is {os.path.getsize(file)} bytes, manifest {info['bytes']}")
                elif "sha256" in info:  # format version 1: the whole file's
                    if file_sha256(file) != info["sha256"]:
                        bad.append(f"{name} sha256 differs")
                else:
                    bad.extend(_verify_by_parts(file, name, info, [e for e in m["tensors"] if e["file"] == name]))
            lines.append(f"    checksums: {'all hold' if not bad else 'FAILED: ' + '; '.join(bad)}")
    for name in sorted(os.listdir(ckpt_dir)):
        if name.startswith(".tmp-"):
            lines.append(f"  {name}: an interrupted save (removed by the next save; never loaded)")
    return lines


def _verify_by_parts(file: str, name: str, info: dict, entries: list[dict]) -> list[str]:
    """A version-2 file's checksums: its header's sha256, then every tensor's over its bytes, which must tile the
    rest of the file (so every byte is covered by one checksum). Returns what failed."""
    try:
        header, _ = read_header(file)
    except CheckpointError as e:
        return [f"{name}: {e}"]
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")  # read_header has checked it against the file's size
        f.seek(0)
        if hashlib.sha256(f.read(8 + length)).hexdigest() != info["header_sha256"]:  # as the writer hashed it
            return [f"{name} header sha256 differs"]
    by_key = {entry_key(e["kind"], e["name"], e["start"]): e for e in entries}
    if set(by_key) != set(header):
        return [f"{name} holds tensors {sorted(set(header) ^ set(by_key))[:5]} the manifest does not list, or the "
                f"other way round"]
    spans = sorted((t.begin, t.end, key) for key, t in header.items())
    at, bad = 8 + length, []
    with open(file, "rb") as f:
        for begin, end, key in spans:
            if begin != at:
                return [f"{name} has bytes no tensor covers at offset {at}"]
            f.seek(begin)
            digest, left = hashlib.sha256(), end - begin
            while left:
                block = f.read(min(COPY_BLOCK, left))
                digest.update(block)
                left -= len(block)
            if digest.hexdigest() != by_key[key]["sha256"]:
                bad.append(f"{name} tensor {key!r} sha256 differs")
            at = end
    if at != info["bytes"]:
        bad.append(f"{name} has {info['bytes'] - at} bytes after its last tensor")
    return bad


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

