"""The model / data / tokenizer pipeline shared by the fine-tuning recipes (DeepSpeed, ColossalAI, FSDP2).

Engine-neutral: nothing here imports DeepSpeed or ColossalAI, and nothing downloads unless asked
to (an HF model or dataset *name*; everything else is local).

* Models: an HF name or local checkpoint directory (``from_pretrained``), or a model-config JSON
  (``configs/models/*.json``: ``{"model_type": "llama", ...}``) built with random weights.
* Text: ``pydoc`` (the Python reference documentation shipped inside every CPython, ~465 K
  characters of human-written prose and examples: always on the machine, nothing to download), a
  ``.txt`` / ``.md`` file, a ``.jsonl`` file (``"text"`` field), a directory of those, or an HF
  dataset as ``hf:<name>[:<config>]``.
* Tokenizer: an HF name or path, or ``train`` — a byte-level BPE trained with HF ``tokenizers`` on
  the text itself and cached in the output directory.
* Packing: documents joined with EOS and cut into blocks of ``seq_len`` tokens; a fixed split into
  train and eval blocks; per-data-parallel-rank batches (tensor-parallel ranks of one replica get the
  same batch, as AutoTP requires).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import sys
import warnings
from typing import Iterator

import torch
import torch.distributed as dist

BUILTIN_TEXT = "pydoc"


# --- known harmless third-party notices --------------------------------------------------------------
KNOWN_HARMLESS_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
     "DeepSpeed 0.19.8 calls the collective torch 2.13 renamed; same result"),
    (FutureWarning, r"`broadcast_buffers` is deprecated",
     "ColossalAI 0.5.0 passes DDP's old argument name; same behaviour"),
    (UserWarning, r"Please install apex from source",
     "ColossalAI's fused RMSNorm kernel is optional (CUDA); its torch RMSNorm runs instead"),
    (UserWarning, r"Please install the latest tensornvme",
     "ColossalAI's optional asynchronous checkpoint writer; checkpoints are written synchronously"),
)
"""(category, message regex, why it is harmless): what ``quiet_known_warnings`` filters."""
QUIET_LOGGERS = {"bitsandbytes.backends.cpu.ops": "an optional 4-bit CPU kernel (\"Failed to load CPU "
                 "gemm_4bit_forward\"), imported through transformers; no 4-bit layer is used"}
"""Loggers set to ERROR by ``quiet_known_warnings``, and why."""


def quiet_known_warnings() -> None:
    """Hide the third-party notices above, which every recipe run printed once per rank;
    anything else still shows. Applied when this module is imported, before the recipes
    import DeepSpeed or ColossalAI. Set ``ZEN_EXT_SHOW_ALL_WARNINGS=1`` to see them."""
    if os.environ.get("ZEN_EXT_SHOW_ALL_WARNINGS") == "1":
        return
    for category, message, _why in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


quiet_known_warnings()


# --- text ------------------------------------------------------------------------------------------
def load_texts(spec: str, text_field: str = "text") -> list[str]:
    """Documents from ``spec`` (see the module docstring).

    Raises:
        FileNotFoundError: a path that does not exist or a directory without text files.
        ValueError: an unsupported file type or an empty corpus.
    """
    if spec == BUILTIN_TEXT:
        import pydoc_data.topics

        docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    elif spec.startswith("hf:"):
        import datasets

        name, _, config = spec[3:].partition(":")
        ds = datasets.load_dataset(name, config or None, split="train")
        docs = [row[text_field] for row in ds]
    elif os.path.isdir(spec):
        files = sorted(f for ext in ("txt", "md", "jsonl") for f in glob.glob(os.path.join(spec, f"**/*.{ext}"),
                                                                            recursive=True))
        if not files:
            raise FileNotFoundError(f"data ({spec!r}) is a directory without .txt, .md or .jsonl files")
        docs = [d for f in files for d in load_texts(f, text_field)]
    elif os.path.isfile(spec):
        if spec.endswith(".jsonl"):
            with open(spec) as f:
                docs = [json.loads(line)[text_field] for line in f if line.strip()]
        elif spec.endswith((".txt", ".md")):
            with open(spec, errors="replace") as f:
                docs = [d for d in f.read().split("\n\n\n") if d.strip()]
        else:
            raise ValueError(f"data file ({spec!r}) must end in .txt, .md or .jsonl")
    else:
        raise FileNotFoundError(f"data ({spec!r}) must be {BUILTIN_TEXT!r}, hf:<name>, or an existing file or "
                                f"directory")
    docs = [d for d in docs if d and d.strip()]
    if not docs:
        raise ValueError(f"data ({spec!r}) holds no text")
    return docs


# --- tokenizer -------------------------------------------------------------------------------------
def build_tokenizer(spec: str, texts: list[str] | None = None, cache_dir: str | None = None,
                    vocab_size: int = 1024):
    """A ``PreTrainedTokenizerFast``: loaded from ``spec``, or trained on ``texts`` when ``spec`` is
    ``"train"`` (byte-level BPE of ``vocab_size``, cached as ``<cache_dir>/tokenizer.json``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec != "train":
        tok = AutoTokenizer.from_pretrained(spec)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    path = os.path.join(cache_dir, "tokenizer.json") if cache_dir else None
    if path is None or not os.path.isfile(path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if not texts:
            raise ValueError("tokenizer 'train' needs texts to train on")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer)
        if path is None:
            return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                           pad_token="<|endoftext|>")
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, path)  # atomic: ranks may race to write the same file
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


# --- model -----------------------------------------------------------------------------------------
def build_model(spec: str, *, seed: int = 0, vocab_size: int | None = None, dtype: torch.dtype | None = None):
    """A causal LM from an HF name / checkpoint directory, or from a model-config JSON (random init).

    Args:
        spec: HF name, local checkpoint directory, or a ``.json`` model config.
        seed: seed of the random initialization (same on every rank, so replicas start equal).
        vocab_size: overrides the config's vocabulary size (to match a trained tokenizer).
        dtype: weights dtype (default: the checkpoint's, or fp32).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.endswith(".json"):
        with open(spec) as f:
            cfg_dict = json.load(f)
        cfg_dict.pop("_comment", None)
        model_type = cfg_dict.pop("model_type")
        if vocab_size is not None:
            cfg_dict["vocab_size"] = vocab_size
        cfg = AutoConfig.for_model(model_type, **cfg_dict)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        return model.to(dtype) if dtype is not None else model
    return AutoModelForCausalLM.from_pretrained(spec, torch_dtype=dtype)


# --- packing and batches ---------------------------------------------------------------------------
def pack_tokens(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Documents tokenized, joined with EOS and cut into ``[num_blocks, seq_len]`` (the tail is dropped)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one block of seq_len ({seq_len})")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split_blocks(blocks: torch.Tensor, eval_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random split into train and eval blocks (at least one eval block when asked for)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(blocks.shape[0], generator=g)
    n_eval = max(1, int(round(blocks.shape[0] * eval_fraction))) if eval_fraction > 0 else 0
    return blocks[perm[n_eval:]], blocks[perm[:n_eval]]


def train_batches(blocks: torch.Tensor, micro_batch: int, dp_rank: int, dp_size: int, seed: int = 0,
                  start_step: int = 0) -> Iterator[torch.Tensor]:
    """Endless micro-batches for one data-parallel rank: each epoch a new shuffle, every rank a
    disjoint share; ``start_step`` skips micro-batches already trained on (resume)."""
    per_epoch = blocks.shape[0] // (micro_batch * dp_size)
    if per_epoch == 0:
        raise ValueError(f"{blocks.shape[0]} training blocks cannot fill one batch of {micro_batch} x {dp_size} ranks")
    step = start_step
    while True:
        epoch, i = divmod(step, per_epoch)
        perm = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
        at = (i * dp_size + dp_rank) * micro_batch
        yield blocks[perm[at: at + micro_batch]]
        step += 1


def eval_batches(blocks: torch.Tensor, micro_batch: int, dp_rank: int, dp_size: int) -> Iterator[torch.Tensor]:
    """This rank's share of the eval blocks, in order."""
    mine = blocks[dp_rank::dp_size]
    for at in range(0, mine.shape[0], micro_batch):
        yield mine[at: at + micro_batch]


# --- the run's shared pieces (both recipes) --------------------------------------------------------
def add_run_args(p, default_output_dir: str) -> None:
    """The command-line arguments both recipes share (model, data, tokenizer, schedule, outputs)."""
    p.add_argument("--model", default="configs/models/llama-tiny-untied.json",
                   help="HF name, checkpoint directory, or model-config JSON (random init)")
    p.add_argument("--data", default=BUILTIN_TEXT, help="pydoc, a .txt/.md/.jsonl file or directory, hf:<name>")
    p.add_argument("--tokenizer", default="train", help="HF name or path, or 'train' (BPE on the data)")
    p.add_argument("--vocab_size", type=int, default=1024, help="vocabulary of a trained tokenizer")
    p.add_argument("--seq_len", type=int, default=128, help="tokens per packed sequence")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (in total, including resumed ones)")
    p.add_argument("--eval_every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval_fraction", type=float, default=0.05, help="share of packed blocks held out for eval")
    p.add_argument("--save_every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--max_docs", type=int, default=0, help="use only the first N documents (0: all)")
    p.add_argument("--data_part", default="all", choices=("all", "first", "second"),
                   help="the first or the second half of the documents (pretrain on one, fine-tune on the other)")
    p.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    p.add_argument("--output_dir", default=default_output_dir)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")


def add_outer_args(p) -> None:
    """``--outer_every`` and friends: local steps with the sparse outer synchronization (``zen.outer``,
    docs/outer.md) instead of a per-step sync. Each flag overrides its key of the config's ``zen.outer``;
    ``--outer_every`` turns it on."""
    p.add_argument("--outer_every", type=int, default=None,
                   help="H: run zen.outer, an outer synchronization every H optimizer steps (docs/outer.md)")
    for name, typ, what in (("density", float, "fraction of each chunk sent (1: dense DiLoCo)"),
                            ("error_decay", float, "error feedback decay β"), ("chunk", int, "elements per top-k chunk"),
                            ("lr", float, "outer SGD learning rate"), ("momentum", float, "outer SGD momentum"),
                            ("average", str, "'contributors' or 'mean'"), ("state_device", str, "'cpu' or 'device'"),
                            ("delay", int, "1: overlap the outer sum with the next round's inner steps")):
        p.add_argument(f"--outer_{name}", type=typ, default=None, help=f"zen.outer.{name}: {what}")
    p.add_argument("--outer_nesterov", action=argparse.BooleanOptionalAction, default=None, help="zen.outer.nesterov")
    p.add_argument("--outer_value_bits", type=int, default=None, help="zen.outer.value_bits: 8 or 4 (ZEN schemes)")


OUTER_FLAGS = ("every", "density", "error_decay", "chunk", "lr", "momentum", "average", "state_device", "nesterov",
               "value_bits", "delay")


def apply_outer_args(args, config: dict) -> None:
    """Write the ``--outer_*`` flags given into ``config["zen"]["outer"]`` (a ``"zen"`` section is created
    when needed; ``--outer_every`` sets ``enabled``). Validation is the config's (``zen.outer.<field>``)."""
    given = {k: getattr(args, f"outer_{k}", None) for k in OUTER_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return
    zen = config.setdefault("zen", {})
    if not isinstance(zen, dict):
        raise ConfigError(f"--outer_* flags need a \"zen\" JSON object in the config, got {zen!r}")
    outer = zen.setdefault("outer", {})
    if "every" in given:
        outer["enabled"] = True
    outer.update(given)


def add_optimizer_args(p) -> None:
    """The optimizer flags the DeepSpeed and FSDP2 recipes share (``optimizer_choice`` reads them)."""
    p.add_argument("--catch_up_adam", action="store_true",
                   help="train with zen_ext.optim.CatchUpAdamW (the config's AdamW settings): a coordinate DGC held "
                   "back for k steps moves k steps' worth when it arrives. The default already when zen.dgc is "
                   "on and the config's optimizer is Adam/AdamW; with this flag any other optimizer is an error")
    p.add_argument("--plain_adam", action="store_true",
                   help="keep the config's optimizer even when zen.dgc is on (by default DGC under Adam/AdamW "
                   "trains with CatchUpAdamW, which closes most of DGC's loss gap to dense)")


def optimizer_choice(args, dgc_on: bool, adam: bool) -> tuple[str, str]:
    """Which optimizer a recipe trains with, and why (for the start line): ``"catch_up"``
    (``--catch_up_adam``, or the default for DGC under an Adam/AdamW config: it closes most of DGC's loss
    gap to dense, README "Time to quality") or ``"config"`` (the config's optimizer: no DGC, not Adam, or
    ``--plain_adam``). ``dgc_on``: the run's ``zen.dgc`` is enabled; ``adam``: the config's optimizer is
    Adam or AdamW."""
    if args.catch_up_adam:
        return "catch_up", "--catch_up_adam"
    if args.plain_adam:
        return "config", "--plain_adam"
    if dgc_on and adam:
        return "catch_up", "the default for DGC under Adam; --plain_adam keeps the config's"
    return "config", "no DGC" if not dgc_on else "not Adam"


WARMUP_TYPES = ("log", "linear")
"""The warm-up curves of DeepSpeed's ``WarmupLR`` (its default: ``log``)."""


def warmup_lr_factor(step: int, warmup_steps: int, warmup_type: str = "log") -> float:
    """The fraction of the peak learning rate that optimizer step ``step`` (1-based) takes in a warm-up from 0,
    as DeepSpeed's ``WarmupLR`` (``warmup_min_lr`` 0) sets it when its engine steps the scheduler after each
    optimizer step, so a recipe without DeepSpeed trains on the same rates (``configs/demo_ds.json``'s).

    DeepSpeed's scheduler starts at index -1 (its minimum, 0) and is one step behind: step ``s`` runs at index
    ``i = s - 2`` (steps 1 and 2 at 0), ``log(i + 1) / log(W)`` (``log``) or ``i / W`` (``linear``) while
    ``i < W``, then 1; ``W = max(2, warmup_steps)`` as DeepSpeed clamps it. ``warmup_steps`` 0: always 1.
    """
    if warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"warmup_type ({warmup_type!r}) must be one of {list(WARMUP_TYPES)}")
    if warmup_steps <= 0:
        return 1.0
    index, span = step - 2, max(2, warmup_steps)
    if index < 0:
        return 0.0
    if index >= span:
        return 1.0
    # DeepSpeed's own arithmetic (the inverse first), so the rates are equal to the last bit.
    return (1.0 / math.log(span)) * math.log(index + 1) if warmup_type == "log" else index / span


def select_texts(texts: list[str], part: str = "all", max_docs: int = 0) -> list[str]:
    """The documents a run uses: all, or the first or second half (``--data_part``: pretrain on one,
    fine-tune on the other), then at most ``max_docs`` of them."""
    half = len(texts) // 2
    texts = texts[:half] if part == "first" else texts[half:] if part == "second" else texts
    return texts[:max_docs] if max_docs else texts


def prepare_data(args, rank: int):
    """Texts → tokenizer (trained once, on rank 0, cached in output_dir) → packed train/eval blocks."""
    texts = select_texts(load_texts(args.data), getattr(args, "data_part", "all"), args.max_docs)
    if rank == 0:
        tokenizer = build_tokenizer(args.tokenizer, texts, args.output_dir, args.vocab_size)
    dist.barrier()
    if rank != 0:
        tokenizer = build_tokenizer(args.tokenizer, texts, args.output_dir, args.vocab_size)
    blocks = pack_tokens(texts, tokenizer, args.seq_len)
    return tokenizer, *split_blocks(blocks, args.eval_fraction, seed=args.seed)


def model_device(model) -> torch.device:
    """Where the model's inputs must go: DeepSpeed's ``engine(...)`` and ColossalAI's DDP (built without
    ``device_ids``) do not move them, so a CPU batch would meet CUDA weights."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def metric_device(group) -> torch.device:
    """Where a metric all-reduced over ``group`` must live: NCCL refuses CPU tensors, gloo takes them."""
    from zen_ext.comm.torch_dist import backend_device

    return backend_device(dist.get_backend(group))


def all_reduce_mean(value: float, group) -> float:
    """Mean of a per-rank Python number over ``group`` (a tensor on the group's device)."""
    t = torch.tensor([value], dtype=torch.float64, device=metric_device(group))
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def evaluate(engine, blocks, micro_batch: int, dp_rank: int, dp_size: int, dp_group, device=None) -> float:
    """Mean loss over the eval blocks (each replica a share, averaged over replicas).

    Batches go to ``device`` (default: the model's; FSDP2's CPU offload keeps parameters on the CPU and
    computes on the accelerator); the totals are summed on the group's device.
    """
    engine.eval()
    device = device if device is not None else model_device(engine)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(blocks, micro_batch, dp_rank, dp_size):
            batch = batch.to(device, non_blocking=True)
            loss = engine(input_ids=batch, labels=batch, use_cache=False).loss
            loss_sum += loss.float().item() * batch.shape[0]
            count += batch.shape[0]
    engine.train()
    total = torch.tensor([loss_sum, count], dtype=torch.float64, device=metric_device(dp_group))
    dist.all_reduce(total, group=dp_group)
    return (total[0] / total[1]).item() if total[1] else float("nan")


def write_outputs(out_dir: str, records: list[dict], summary_text: str | None, extra: dict | None = None) -> None:
    """summary.json (with ``extra``'s keys added) and loss.png (rank 0)."""
    losses = [r["loss"] for r in records]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    last = records[-1] if records else {}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"steps": len(records), "losses": losses, "eval": evals, "final": last,
                   "zen_summary": summary_text, **(extra or {})}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], losses, label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=100)
    plt.close(fig)


def progress_bar(rank: int, start: int, steps: int):
    """A tqdm bar on rank 0 showing loss, tokens/s and bytes communicated; a no-op elsewhere."""
    if rank != 0:
        return lambda rec: None
    from tqdm import tqdm

    from zen_ext.reduction.stats import format_bytes

    bar = tqdm(total=steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout, mininterval=1.0)

    def update(rec: dict) -> None:
        post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
        if rec.get("bytes_sent") is not None:
            post["sent"] = format_bytes(rec["bytes_sent"])
            if rec.get("dense_bytes"):
                post["vs_dense"] = f"{rec['bytes_sent'] / rec['dense_bytes']:.0%}"
        if "eval_loss" in rec and math.isfinite(rec["eval_loss"]):
            post["eval"] = f"{rec['eval_loss']:.4f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)
        if rec["step"] == steps:
            bar.close()

    return update


def log_step(rec: dict, log_file, records: list[dict], progress) -> None:
    """A step's record, the same in every recipe: its JSON line (rank 0 holds ``log_file``; the others
    pass ``None``), the run's records and the progress bar."""
    if log_file is not None:
        log_file.write(json.dumps(rec) + "\n")
        log_file.flush()
    records.append(rec)
    progress(rec)


class StepLog:
    """A run's step records, kept the same way by every recipe: rank 0 appends each to
    ``<output_dir>/train_log.jsonl`` (a resumed run continues the file) and shows it on its progress bar;
    every rank keeps them in ``records``. ``close`` writes the run's outputs on rank 0 (``write_outputs``)."""

    def __init__(self, output_dir: str, rank: int, start: int, steps: int) -> None:
        self.output_dir, self.rank = output_dir, rank
        self.file = open(os.path.join(output_dir, "train_log.jsonl"), "a") if rank == 0 else None
        self.progress = progress_bar(rank, start, steps)
        self.records: list[dict] = []

    def log(self, rec: dict) -> None:
        log_step(rec, self.file, self.records, self.progress)

    def close(self, summary_text: str | None, extra: dict | None = None) -> None:
        if self.rank == 0:
            self.file.close()
            write_outputs(self.output_dir, self.records, summary_text, extra)


def gather_peak_memory(world: int, **extra) -> list[dict]:
    """Every rank's peak resident memory in MiB (CPU tensors live there; ``ru_maxrss`` is KiB on Linux),
    with ``extra`` fields of its own, gathered to every rank (a collective: all ranks call it)."""
    import resource

    peak: list = [None] * world
    dist.all_gather_object(peak, {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra})
    return peak


# --- configuration errors: one line, once --------------------------------------------------------------
class ConfigError(Exception):
    """A bad configuration, found before training starts (the message is the validator's one line)."""


# --- which optimizer a checkpoint was saved with -------------------------------------------------------
OPTIMIZER_FILE = "recipe_optimizer.json"
"""Written next to a checkpoint's files: the optimizer's name, so that a resume under another optimizer
(CatchUpAdamW's state has an age per element and its own groups) fails with a line that says which flag
or field brings back the saved one, not inside torch's ``load_state_dict``."""


def save_optimizer_name(ckpt_path: str, name: str, rank: int) -> None:
    """Rank 0 records ``name`` (the run's optimizer) in the checkpoint folder ``ckpt_path``."""
    if rank == 0:
        with open(os.path.join(ckpt_path, OPTIMIZER_FILE), "w") as f:
            json.dump({"optimizer": name}, f)


def check_optimizer_name(ckpt_path: str, name: str, how_to_get, why: str = "") -> None:
    """Raise a ``ConfigError`` before the checkpoint in ``ckpt_path`` is loaded when it was saved with
    another optimizer than ``name`` (checkpoints from before the file existed are not checked).

    Args:
        ckpt_path: the checkpoint's folder.
        name: this run's optimizer, as ``save_optimizer_name`` would record it.
        how_to_get: maps the saved name to what the user sets to resume with it (a flag, a config field).
        why: why this run chose ``name`` (the start line's reason), for the message.
    """
    path = os.path.join(ckpt_path, OPTIMIZER_FILE)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f).get("optimizer")
    if saved != name:
        raise ConfigError(f"--resume: the checkpoint {ckpt_path} was saved with optimizer {saved}, but this run "
                          f"trains with {name}{f' ({why})' if why else ''}, whose state differs; resume with "
                          f"{how_to_get(saved)}, or start a new --output_dir")


def exit_on_config_error(main, *args):
    """Run a recipe's ``main``; a ``ConfigError`` is printed once, by rank 0, as its one line, and every
    rank exits with status 2. ``ZEN_DEBUG=1`` re-raises it with the full traceback."""
    try:
        return main(*args)
    except ConfigError as exc:
        if os.environ.get("ZEN_DEBUG", "0") == "1":
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"zen_ext: configuration error: {exc} (ZEN_DEBUG=1 shows the traceback)", file=sys.stderr,
                  flush=True)
        sys.exit(2)


def run_main(main) -> None:
    """A recipe's entry point: ``main`` under ``exit_on_config_error``, then every rank leaves the process
    group together (a rank that left first would fail the others' last collective)."""
    exit_on_config_error(main)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
