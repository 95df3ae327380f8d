"""The ``transformers`` engine: the target model in the worker process, batched ``generate``.

Prompts are rendered with the model's own chat template (``enable_thinking`` from the job) in the
sized sandbox (:func:`dfp_shared.chat_template.render_chat`), sorted by length and generated in
left-padded batches; CUDA is used when present. A batch that fails (e.g. out of memory) is retried
one request at a time so one bad prompt fails alone.
"""

from __future__ import annotations

import logging

import torch
from dfp_shared.chat_template import render_chat
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.records.thinking import split_thinking

from .base import Engine, GenRequest, GenResult, ResultCallback, SamplingParams, StopCheck

log = logging.getLogger(__name__)


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model_uri: str, *, device: str | None = None, dtype: str | None = None, batch_size: int = 8,
                 endpoint_url: str | None = None, model_name: str | None = None):
        from dfp_shared.models.loading import load_causal_lm, local_model_dir, text_config
        from dfp_shared.models.tokenizer_assets import load_tokenizer

        path = local_model_dir(model_uri, endpoint_url=endpoint_url)
        self.tokenizer = load_tokenizer(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_causal_lm(str(path), device=device, dtype=dtype)
        self.device = next(self.model.parameters()).device
        self.batch_size = batch_size
        self.model_name = model_name or model_uri
        self.stop_ids = stop_token_ids(self.tokenizer, getattr(self.model.generation_config, "eos_token_id", None))
        self.max_positions = getattr(text_config(self.model.config), "max_position_embeddings", None)
        log.info("transformers engine ready", extra={"model": self.model_name, "device": str(self.device),
                                                     "batch_size": batch_size})

    def render(self, messages: list[dict], thinking: bool) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt=True, enable_thinking=thinking)

    def generate(self, requests: list[GenRequest], params: SamplingParams, *, on_result: ResultCallback | None = None,
                 should_stop: StopCheck | None = None) -> list[GenResult]:
        rendered = []
        results: list[GenResult] = []
        for req in requests:
            try:
                ids = self.tokenizer(self.render(req.messages, params.thinking), add_special_tokens=False)["input_ids"]
            except Exception as exc:  # noqa: BLE001 - a template error belongs to this prompt only
                ids, error = None, f"chat template failed: {type(exc).__name__}: {exc}"
            else:
                error = (f"prompt too long: {len(ids)} tokens, the model's context is {self.max_positions}"
                         if self.max_positions and len(ids) >= self.max_positions else None)
            if error is None:
                rendered.append((req, ids))
                continue
            res = GenResult(id=req.id, error=error)
            results.append(res)
            if on_result:
                on_result(res)
        rendered.sort(key=lambda item: len(item[1]))
        for start in range(0, len(rendered), self.batch_size):
            if should_stop and should_stop():
                break
            batch = rendered[start:start + self.batch_size]
            try:
                out = self._generate_batch(batch, params)
            except Exception as exc:  # noqa: BLE001 - retry alone so one bad prompt fails alone
                log.warning("batch failed; retrying its prompts one by one", extra={"error": str(exc)})
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                out = []
                for item in batch:
                    try:
                        out += self._generate_batch([item], params)
                    except Exception as one_exc:  # noqa: BLE001
                        out.append(GenResult(id=item[0].id, error=f"generation failed: {type(one_exc).__name__}: {one_exc}"))
            for res in out:
                results.append(res)
                if on_result:
                    on_result(res)
        return results

    @torch.inference_mode()
    def _generate_batch(self, batch: list[tuple[GenRequest, list[int]]], params: SamplingParams) -> list[GenResult]:
        pad_id = self.tokenizer.pad_token_id
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, ids) in enumerate(batch):  # left padding
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention[row, width - len(ids):] = 1
        torch.manual_seed(batch[0][0].seed)  # one seed per batch: reruns of the same shard match
        sample = params.temperature > 0
        extra = {"temperature": params.temperature, "top_p": params.top_p} if sample else {}
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            max_new_tokens=params.max_new_tokens, do_sample=sample, top_k=0 if sample else None,
            pad_token_id=pad_id, eos_token_id=self.stop_ids, **extra,
        )  # (B, width + new)
        generated = out[:, width:].tolist()
        results = []
        for (req, ids), row in zip(batch, generated):
            stop_at = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
            if stop_at is None:
                tokens, finish, n_out = row[:params.max_new_tokens], "length", min(len(row), params.max_new_tokens)
            else:
                tokens, finish, n_out = row[:stop_at], "stop", stop_at + 1
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            reasoning, answer, _closed = split_thinking(text)
            results.append(GenResult(id=req.id, content=answer, reasoning=reasoning, finish_reason=finish,
                                     prompt_tokens=len(ids), completion_tokens=n_out))
        return results

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
