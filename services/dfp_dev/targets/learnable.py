"""A small Qwen3 target trained on the standard library's documented functions.

Unlike the random-initialised tiny target, its greedy outputs have structure (Python source that
answers a request for a named function), so a drafter has something real to learn. It uses the
real Qwen3 tokenizer and chat template; conversations are rendered exactly as the generation
stage prompts a target in thinking mode, and the loss covers the assistant turn only
(``<think>\\n\\n</think>\\n\\n``, the source, ``<|im_end|>``).

The 151k-row LM head would dominate the compute on a CPU, so training uses only the rows of the
token set U that occurs in the corpus: rows outside U stay exactly zero, their logits are
exactly 0, and the full-vocabulary softmax is the softmax over U's logits plus one folded term
``log(V - |U|)`` (:func:`folded_cross_entropy`). The saved checkpoint has the full head.

A build is a pure function of the corpus, the model config, the training settings, the
tokenizer files and :data:`BUILDER_VERSION`; it is cached under a hash of all of them.

Measured on a 2-core CPU, one thread, 1024-token steps, the default 6 x 128 shape (padded
tokens per second): the full 151k head and embedding ~220/s; the folded head over the whole
corpus's U (16.6k ids) ~1.5k/s; over the 8000-id cap (|U| ~5.2k, ~1.5k records) ~3.7k/s. The
default 700 steps take about three minutes (five passes, final loss ~2.4).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from dfp_shared.chat_template import render_chat
from dfp_shared.models.tokenizer_assets import MASK_TOKEN, load_tokenizer

from .stdlib_corpus import FunctionRecord, prompt_records, sample_prompts, stdlib_functions, write_prompt_set

log = logging.getLogger(__name__)

BUILDER_VERSION = 1
INFO_FILE = "dflash_learnable.json"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 6
    hidden_size: int = 128
    intermediate_size: int = 384
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vLLM's CPU build serves no head size under 32
    max_position_embeddings: int = 4096


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 700
    batch_tokens: int = 1024  # padded tokens per step (sequences of similar length are batched together)
    lr: float = 4e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1  # one intra-op thread: on a shared 2-core machine oversubscription is ~10x slower
    max_answer_tokens: int = 300  # longer assistant turns are left out
    vocab_cap: int | None = 8000  # keep only records whose tokens are among the corpus's this many most frequent


@dataclass(frozen=True)
class LearnableTarget:
    """A built (or cached) target: its directory, whether it came from the cache, and its build record."""

    path: Path
    hit: bool
    info: dict = field(default_factory=dict)

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def train_prompts(self) -> Path:
        return self.path / "prompts" / "train.jsonl"

    @property
    def held_out_prompts(self) -> Path:
        return self.path / "prompts" / "held-out.jsonl"

    @property
    def demo_prompts(self) -> Path:
        return self.path / "prompts" / "demo.jsonl"


@lru_cache(maxsize=4)
def _stdlib_records(limit: int | None) -> tuple[FunctionRecord, ...]:
    return tuple(stdlib_functions(limit=limit))


def folded_cross_entropy(logits_u: torch.Tensor, targets_u: torch.Tensor, num_outside: int) -> torch.Tensor:
    """Mean full-vocabulary cross-entropy when the ``num_outside`` logits outside U are exactly 0.

    ``logits_u`` (N, |U|) are the logits of U's tokens, ``targets_u`` (N,) indexes into U. The
    zero logits add ``num_outside * exp(0)`` to the partition sum: one term ``log(num_outside)``.
    """
    lse = torch.logsumexp(logits_u, dim=-1)
    if num_outside > 0:
        lse = torch.logaddexp(lse, torch.tensor(math.log(num_outside), dtype=logits_u.dtype))
    return (lse - logits_u.gather(-1, targets_u[:, None]).squeeze(-1)).mean()


def tokenizer_digest(tokenizer_dir: str | os.PathLike) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in Path(tokenizer_dir).iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def build_hash(records, shape: ModelShape, settings: TrainSettings, tokenizer_dir, demo_prompts: int = 32) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"version": BUILDER_VERSION, "shape": asdict(shape), "train": asdict(settings),
                         "tokenizer": tokenizer_digest(tokenizer_dir), "demo_prompts": demo_prompts},
                        sort_keys=True).encode())
    for record in records:  # the conversations themselves, so a change of the request's wording is a new build
        h.update(json.dumps([record.id, record.messages()], ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def render_texts(tok, record: FunctionRecord) -> tuple[str, str]:
    """The thinking-mode prompt and the assistant turn (ending at ``<|im_end|>``) of one conversation.

    The prompt is rendered as the generation stage prompts a target; the rest of the chat
    template's render of the whole conversation is what the target learns to produce.
    """
    prompt = render_chat(tok, record.prompt_messages(), add_generation_prompt=True, enable_thinking=True)
    full = render_chat(tok, record.messages())
    if not full.startswith(prompt):
        raise ValueError(f"{record.id}: the chat template's prompt is not a prefix of the conversation")
    answer = full[len(prompt):]
    return prompt, answer[:answer.rindex("<|im_end|>") + len("<|im_end|>")]


def prepare_examples(tok, records, settings: TrainSettings):
    """(kept records, examples [(ids, prompt_len)], U: sorted token ids used) after the length and vocab caps."""
    texts = [render_texts(tok, r) for r in records]
    prompt_ids = tok([p for p, _ in texts], add_special_tokens=False)["input_ids"] if texts else []
    answer_ids = tok([a for _, a in texts], add_special_tokens=False)["input_ids"] if texts else []
    kept, examples = [], []
    for record, p_ids, a_ids in zip(records, prompt_ids, answer_ids, strict=True):
        if len(a_ids) <= settings.max_answer_tokens:
            kept.append(record)
            examples.append((p_ids + a_ids, len(p_ids)))
    counts = Counter(t for ids, _ in examples for t in ids)
    if settings.vocab_cap is not None and len(counts) > settings.vocab_cap:
        allowed = {t for t, _ in counts.most_common(settings.vocab_cap)}
        pairs = [(r, e) for r, e in zip(kept, examples, strict=True) if allowed.issuperset(e[0])]
        kept, examples = [r for r, _ in pairs], [e for _, e in pairs]
        counts = Counter(t for ids, _ in examples for t in ids)
    return kept, examples, sorted(counts)


def make_batches(examples, batch_tokens: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, labels) batches of similar-length examples; labels mask the prompt and pads."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), i))
    batches, current = [], []

    def flush():
        width = max(len(examples[i][0]) for i in current)
        ids = torch.full((len(current), width), pad_id, dtype=torch.long)
        labels = torch.full((len(current), width), -100, dtype=torch.long)
        for row, i in enumerate(current):
            seq, plen = examples[i]
            ids[row, :len(seq)] = torch.tensor(seq)
            labels[row, plen:len(seq)] = torch.tensor(seq[plen:])
        batches.append((ids, labels))

    for i in order:
        if current and (len(current) + 1) * len(examples[i][0]) > batch_tokens:
            flush()
            current = []
        current.append(i)
    if current:
        flush()
    return batches


def qwen3_config(tok, shape: ModelShape):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=len(tok), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                       num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                       num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                       max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=False,
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))


class FoldedVocabLM(torch.nn.Module):
    """A Qwen3 body with embedding and head rows for U only; :meth:`export` writes them into the full model."""

    def __init__(self, model, used_ids: list[int]):
        super().__init__()
        self.model = model
        self.register_buffer("used", torch.tensor(used_ids, dtype=torch.long), persistent=False)
        self.embed_u = torch.nn.Parameter(model.get_input_embeddings().weight.detach()[self.used].clone())
        self.head_u = torch.nn.Parameter(model.get_output_embeddings().weight.detach()[self.used].clone())
        self.num_outside = model.config.vocab_size - len(used_ids)
        model.get_input_embeddings().weight.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(False)

    def loss(self, ids_u: torch.Tensor, labels_u: torch.Tensor) -> torch.Tensor:
        """Next-token loss on ids already mapped to U's indices (labels -100 where masked)."""
        hidden = self.model.model(inputs_embeds=F.embedding(ids_u, self.embed_u)).last_hidden_state
        targets = labels_u[:, 1:]
        keep = targets != -100
        logits = hidden[:, :-1][keep] @ self.head_u.T
        return folded_cross_entropy(logits, targets[keep], self.num_outside)

    @torch.no_grad()
    def export(self):
        self.model.get_input_embeddings().weight[self.used] = self.embed_u
        head = self.model.get_output_embeddings().weight
        head.zero_()
        head[self.used] = self.head_u
        return self.model


def _lr_at(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(lm: FoldedVocabLM, batches, settings: TrainSettings, log_every: int = 25, on_step=None) -> dict:
    """AdamW over a fixed number of steps; batches are visited in a seeded order, reshuffled each epoch."""
    index = torch.full((lm.model.config.vocab_size,), -1, dtype=torch.long)
    index[lm.used] = torch.arange(len(lm.used))

    batches = [(index[ids].clamp(min=0), torch.where(labels >= 0, index[labels.clamp(min=0)], -100))
               for ids, labels in batches]  # padding outside U reads row 0: it is never a label
    params = [p for p in lm.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
    lm.train()
    order: list[int] = []
    epoch, seen_tokens, window_loss, window_n, window_tokens = 0, 0, 0.0, 0, 0
    start = window_start = time.perf_counter()
    losses = []
    for step in range(settings.steps):
        if not order:
            order = list(range(len(batches)))
            random.Random(settings.seed * 1000 + epoch).shuffle(order)
            epoch += 1
        ids, labels = batches[order.pop()]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, settings)
        loss = lm.loss(ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        opt.step()
        seen_tokens += ids.numel()
        losses.append(loss.item())
        window_loss += losses[-1]
        window_n += 1
        window_tokens += ids.numel()
        if on_step is not None:
            on_step(step + 1, settings.steps, losses[-1])
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            now = time.perf_counter()
            log.info("step %d/%d  loss %.4f  %.0f tokens/s  epoch %d", step + 1, settings.steps,
                     window_loss / window_n, window_tokens / max(now - window_start, 1e-9), epoch)
            window_loss, window_n, window_tokens, window_start = 0.0, 0, 0, now
    elapsed = time.perf_counter() - start
    tail = losses[-max(1, min(50, len(losses) // 5)):]
    return {"final_loss": sum(tail) / len(tail), "last_loss": losses[-1], "train_seconds": round(elapsed, 2),
            "tokens": seen_tokens, "tokens_per_second": round(seen_tokens / max(elapsed, 1e-9)), "epochs": epoch}


def default_root() -> Path:
    """Where built targets are cached on this machine (shared by the demo, the benchmark and the CLI)."""
    from dfp_shared.models.tokenizer_assets import default_cache_dir

    return Path(default_cache_dir()) / "targets"


def target_dir_name(digest: str) -> str:
    return f"learnable-qwen3-{digest[:12]}"


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (path / INFO_FILE).is_file()


def build_learnable_target(out_root: str | os.PathLike, tokenizer_dir: str | os.PathLike, *,
                           shape: ModelShape = ModelShape(), settings: TrainSettings = TrainSettings(),
                           max_records: int | None = None, demo_prompts: int = 32,
                           log_every: int = 25, on_step=None) -> LearnableTarget:
    """Build (or find in the cache) the learnable target under ``out_root/learnable-qwen3-<hash>``.

    ``max_records`` keeps only the first records of the corpus (for quick builds in tests).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    records = _stdlib_records(max_records)
    digest = build_hash(records, shape, settings, tokenizer_dir, demo_prompts)
    root = Path(out_root)
    out = root / target_dir_name(digest)
    if _is_built(out):
        log.info("learnable target %s: cache hit", out)
        return LearnableTarget(out, True, json.loads((out / INFO_FILE).read_text()))

    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_dir, add_mask_token=True)
    kept, examples, used = prepare_examples(tok, records, settings)
    n_tokens = sum(len(ids) for ids, _ in examples)
    n_answer = sum(len(ids) - plen for ids, plen in examples)
    log.info("corpus: %d of %d records, %d tokens (%d in answers), |U| = %d of %d", len(kept), len(records),
             n_tokens, n_answer, len(used), len(tok))
    batches = make_batches(examples, settings.batch_tokens, tok.pad_token_id or 0)

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        torch.manual_seed(settings.seed)
        model = AutoModelForCausalLM.from_config(qwen3_config(tok, shape), dtype=torch.float32)
        lm = FoldedVocabLM(model, used)
        stats = train(lm, batches, settings, log_every=log_every, on_step=on_step)
        model = lm.export().eval()
    finally:
        torch.set_num_threads(threads)

    info = {"hash": digest, "builder_version": BUILDER_VERSION, "shape": asdict(shape), "train": asdict(settings),
            "records": len(kept), "corpus_records": len(records), "corpus_tokens": n_tokens,
            "answer_tokens": n_answer, "used_vocab": len(used), "vocab_size": len(tok), "batches": len(batches),
            "mask_token": MASK_TOKEN, **stats, "build_seconds": round(time.perf_counter() - t0, 2)}
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        write_prompt_set(tmp / "prompts" / "train.jsonl", prompt_records(kept, "train"))
        write_prompt_set(tmp / "prompts" / "held-out.jsonl", prompt_records(kept, "held-out"))
        write_prompt_set(tmp / "prompts" / "demo.jsonl", sample_prompts(kept, demo_prompts))
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the target from servers running as other users
        try:
            os.rename(tmp, out)
        except OSError:  # a concurrent build got there first: same hash, same content
            if not _is_built(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("learnable target %s built in %.1fs (final loss %.3f)", out, info["build_seconds"], info["final_loss"])
    return LearnableTarget(out, False, info)


def greedy_samples(model_dir: str | os.PathLike, prompts: list[dict], max_new_tokens: int = 256) -> list[str]:
    """The target's greedy completions (special tokens kept) of prompt records, thinking-mode prompts."""
    from dfp_shared.models.loading import load_causal_lm

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(str(model_dir), device="cpu")  # safetensors only, no remote code
    out = []
    for prompt in prompts:
        text = render_chat(tok, prompt["messages"], add_generation_prompt=True, enable_thinking=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False))
    return out


def _build_target_command():
    import click

    @click.command("build-target")
    @click.option("--out", "out_root", default=None, help="Directory of built targets [default: the cache dir].")
    @click.option("--tokenizer-dir", default=None, help="Qwen3 tokenizer directory [default: fetched once].")
    @click.option("--steps", type=int, default=TrainSettings.steps, show_default=True, help="Training steps.")
    @click.option("--samples", type=int, default=0, show_default=True,
                  help="Print this many greedy completions of held-out prompts.")
    def build_target(out_root, tokenizer_dir, steps, samples):
        """Build (or find in the cache) the learnable Qwen3 target; print its directory."""
        from dataclasses import replace

        from dfp_shared.records.prompts import read_prompt_set

        from .qwen3_tokenizer import qwen3_tokenizer_dir

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        root = Path(out_root) if out_root else default_root()
        built = build_learnable_target(root, tokenizer_dir or qwen3_tokenizer_dir(),
                                       settings=replace(TrainSettings(), steps=steps))
        click.echo(f"{built.path}  ({'cache hit' if built.hit else 'built'}; final loss {built.info['final_loss']:.3f})")
        if samples:
            prompts, _ = read_prompt_set(str(built.held_out_prompts), limit=samples)
            records = [{"messages": p.messages} for p in prompts]
            for prompt, text in zip(prompts, greedy_samples(built.path, records), strict=True):
                click.echo(f"--- {prompt.id}: {prompt.messages[-1]['content']}\n{text}")

    return build_target


build_target = _build_target_command()
