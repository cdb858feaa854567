"""The Hugging Face suite: generation at stage 3 and sharded from_pretrained, on the bench's 25m model as an HF GPT-2.

    python bench/run.py --suite hf                          # 25m shape, world 2 (generation), worlds 1/2/4 (loading)

Generation: greedy generate() of 32 new tokens (batch 2, prompt 8) at world 2, stage 3, with the units gathered
and freed at every forward (plain) and with engine.gathered_for_generation() (each unit gathered once), against the
same model unsharded in the same processes (stock transformers, the limit). Loading: peak resident memory growth
(VmHWM) of each rank while zkern.hf.from_pretrained reads its shards, against transformers' own
GPT2LMHeadModel.from_pretrained in a process of the same kind (every rank of a DeepSpeed ZeRO-3 job pays that), and
against this rank's share of the model plus the largest tensor.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import torch

from bench.engine_suite import MODELS
from zkern.testing.ranks import spawn

NEW_TOKENS, PROMPT, BATCH = 32, 8, 2


def _gpt2_config(model: str):
    from transformers import GPT2Config

    m = MODELS[model]["model"]
    return GPT2Config(vocab_size=m["vocab"], n_positions=m["seq"], n_embd=m["dim"], n_layer=m["n_layer"],
                      n_head=m["n_head"], bos_token_id=0, eos_token_id=0)


def _stage3(world: int) -> dict:
    return {"train_batch_size": world, "device": "cpu", "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 512 * 512}}


def _generate_rank(rank: int, world: int, model: str) -> dict:
    import transformers
    from transformers import GPT2LMHeadModel

    import zkern

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(_gpt2_config(model)).eval()
    prompt = torch.randint(1, net.config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    net.generate(prompt, max_new_tokens=2, pad_token_id=0)  # warm-up
    whole_s, whole = timed(lambda: net.generate(prompt, **kwargs))
    engine = zkern.Engine(net, _stage3(world))
    engine.eval()
    engine.module.generate(prompt, max_new_tokens=2, pad_token_id=0)
    plain_s, plain = timed(lambda: engine.module.generate(prompt, **kwargs))

    def gathered():
        with engine.gathered_for_generation():
            return engine.module.generate(prompt, **kwargs)

    once_s, once = timed(gathered)
    return {"whole_s": whole_s, "plain_s": plain_s, "gathered_s": once_s,
            "tokens_equal": torch.equal(whole, plain) and torch.equal(whole, once)}


def _load_rank(rank: int, world: int, path: str, how: str) -> dict:
    from zkern.testing import gpt2_load_peak

    model, grown, seconds = gpt2_load_peak(path, _stage3(world) if how == "zkern" else None)
    if how == "zkern":
        return {"grown": grown, "seconds": seconds}
    # transformers maps the file and its tensors may stay file pages until read: read every weight once, as
    # training does (the optimizer then writes them, which makes them this process's own memory).
    from zkern.testing import peak_rss_bytes

    loaded = peak_rss_bytes()  # the peak is monotone: loaded = the count's start + grown
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())
    return {"grown": grown, "grown_read": grown + peak_rss_bytes() - loaded, "seconds": seconds}


def run(model: str = "25m") -> dict:
    from transformers import GPT2LMHeadModel

    gen = spawn(_generate_rank, 2, model, subprocess=True, timeout=1800)
    root = tempfile.mkdtemp(prefix="zkern-bench-hf-")
    try:
        torch.manual_seed(0)
        reference = GPT2LMHeadModel(_gpt2_config(model))
        reference.save_pretrained(root)
        params = {id(p): p for p in reference.parameters()}.values()
        model_bytes = sum(p.numel() * 4 for p in params)
        largest = max(p.numel() * 4 for p in params)
        del reference
        stock = spawn(_load_rank, 1, root, "transformers", subprocess=True, timeout=600)[0]
        loads = {w: spawn(_load_rank, w, root, "zkern", subprocess=True, timeout=600) for w in (1, 2, 4)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = max(r["plain_s"] for r in gen)
    once = max(r["gathered_s"] for r in gen)
    peaks = {w: max(r["grown"] for r in ranks) for w, ranks in loads.items()}
    return {"suite": "hf", "model": model, "device": "cpu", "threads": torch.get_num_threads(),
            "model_bytes": model_bytes, "largest_tensor_bytes": largest,
            "generate": {"new_tokens": NEW_TOKENS, "batch": BATCH, "world": 2,
                         "whole_s": max(r["whole_s"] for r in gen),
                         "stage3_plain_s": plain, "stage3_gathered_s": once,
                         "tokens_equal": all(r["tokens_equal"] for r in gen)},
            "from_pretrained": {"transformers_peak": stock["grown"], "transformers_peak_read": stock["grown_read"],
                                "transformers_s": stock["seconds"],
                                "zkern_peak": {str(w): p for w, p in peaks.items()},
                                "zkern_s": {str(w): max(r["seconds"] for r in ranks) for w, ranks in loads.items()}},
            "ratios": {"generate_speedup": plain / once,
                       "generate_gathered_over_whole": once / max(r["whole_s"] for r in gen),
                       "from_pretrained_peak_w4_over_transformers_read": peaks[4] / stock["grown_read"],
                       "from_pretrained_peak_over_bound": max(
                           peaks[w] / (model_bytes / w + largest) for w in peaks)}}


def table(record: dict) -> str:
    mib = 2 ** 20
    g, f, r = record["generate"], record["from_pretrained"], record["ratios"]
    lines = [f"hf suite: the {record['model']} shape as an HF GPT-2 ({record['model_bytes'] / mib:.0f} MiB fp32, "
             f"largest tensor {record['largest_tensor_bytes'] / mib:.0f} MiB), {record['threads']} threads", "",
             f"generate(): {g['new_tokens']} new tokens, batch {g['batch']}, greedy, world {g['world']} stage 3 "
             f"(tokens equal the unsharded model's: {g['tokens_equal']})", "",
             "| path | seconds | vs gathered_for_generation |", "|---|---|---|",
             f"| stage 3, units gathered per forward | {g['stage3_plain_s']:.2f} | x{r['generate_speedup']:.1f} |",
             f"| stage 3, engine.gathered_for_generation() | {g['stage3_gathered_s']:.2f} | x1 |",
             f"| unsharded model (stock transformers) | {g['whole_s']:.2f} | "
             f"x{1 / r['generate_gathered_over_whole']:.2f} |", "",
             "from_pretrained peak resident growth per rank:", "",
             "| loader | world | peak MiB | share + largest MiB | seconds |", "|---|---|---|---|---|",
             f"| transformers GPT2LMHeadModel.from_pretrained (file mapped, weights unread) | (each rank) | "
             f"{f['transformers_peak'] / mib:.1f} | - | {f['transformers_s']:.2f} |",
             f"| the same after reading every weight once | (each rank) | {f['transformers_peak_read'] / mib:.1f} | "
             f"- | - |"]
    for w, peak in f["zkern_peak"].items():
        bound = record["model_bytes"] / int(w) + record["largest_tensor_bytes"]
        lines.append(f"| zkern.hf.from_pretrained | {w} | {peak / mib:.1f} | {bound / mib:.1f} | "
                     f"{f['zkern_s'][w]:.2f} |")
    return "\n".join(lines)
