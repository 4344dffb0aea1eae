"""``TextSamples``: what the model writes, in TensorBoard's text tab, decoded with the newest weights.

Generation goes through the pipeline's predict path (docs/design/lightning.md, "Text samples through predict"): one
``predict`` call per new token, on every stage of every pipeline alike. Only a pipeline's first stage reads the
token ids (the others receive activations), and only the first stage gets the logits back, so the first stage
picks the tokens and nothing else has to travel: the other stages pass a stand-in batch of the same number of
rows, which is all they use of it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_async_pp.models.vocab import model_vocab_size
from lightning_async_pp.module import PipelineModule

#: The byte-level vocabulary of this package's data (``data.TextDataModule``).
BYTE_VOCAB = 256


def encode_bytes(text: str) -> list[int]:
    """UTF-8 bytes as token ids (the embedded corpus's tokenization)."""
    return list(text.encode("utf-8"))


def decode_bytes(ids: Sequence[int]) -> str:
    """Token ids as UTF-8 bytes; a sequence cut inside a character shows a replacement character."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TextSamples: {name} must be a positive integer, got {value!r}")
    return value


class TextSamples(Callback):
    """At validation, every ``every_n_steps`` training steps, continue each prompt by ``max_new_tokens`` tokens with
    the newest weights and log prompt + continuation to TensorBoard's text tab (tag ``{tag}/{i}`` for prompt ``i``,
    on global rank 0).

    Works under any strategy: under ``AsyncPipelineStrategy`` (one device or several processes) every token is one
    ``predict`` call through the pipeline; otherwise the module's sequential forward. The model must take a batch
    of (B, T + 1) token ids and read all but the last column (``pipeline_input(batch) == batch[:, :-1]``, as
    ``models.GPT`` and ``models.Llama`` do), and return logits (B, T, vocab). There is no key/value cache: each
    token runs the whole context (the last ``max_context`` tokens) forward.

    Args:
        prompts: the texts to continue (a list, even of one).
        every_n_steps: decode at the first validation at or after every multiple of this many training steps
            (validation runs at ``trainer.val_check_interval``). A ``trainer.validate`` call always decodes.
        max_new_tokens: tokens generated per prompt.
        temperature: 0 picks the most likely token (greedy, deterministic); above 0 samples from the softmax of
            ``logits / temperature``.
        top_k: when sampling, only among the ``top_k`` most likely tokens (``None``: all).
        seed: seed of the sampling generator, reset at every decoding, so a run's samples are reproducible.
        decode: token ids -> text (any callable, e.g. a tokenizer's ``decode``). Default: the data module's
            tokenizer (``TextDataModule(tokenizer=...)``, or the one a prepared ``data_path`` was tokenized with);
            without one, UTF-8 bytes, which needs a vocabulary of at most 256.
        encode: text -> token ids, for the prompts (a list of ids, or anything with ``.ids``, such as the
            ``tokenizers.Encoding`` of ``Tokenizer.encode``). Default: as ``decode``. Give it whenever ``decode`` is
            given.
        max_context: longest context fed to the model; default the model's ``max_seq_len`` or ``block_size``
            hyperparameter, unbounded when it has neither.
        tag: TensorBoard tag prefix (and the callback's key in checkpoints: give each TextSamples its own).

    ``history`` keeps ``(global_step, continuations)`` for each decoding on the ranks that pick tokens (the first
    stage of each pipeline; every rank without a pipeline strategy).
    """

    def __init__(
        self,
        prompts: Sequence[str],
        every_n_steps: int = 100,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        seed: int = 0,
        decode: Optional[Callable[[list[int]], str]] = None,
        encode: Optional[Callable[[str], list[int]]] = None,
        max_context: Optional[int] = None,
        tag: str = "samples",
    ) -> None:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ValueError(f"TextSamples: prompts must be a list of strings, got {prompts!r}; write [{prompts!r}]"
                             if isinstance(prompts, str) else
                             f"TextSamples: prompts must be a list of strings, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("TextSamples: prompts is empty; give at least one prompt")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p:
                raise ValueError(f"TextSamples: prompts[{i}] must be a non-empty string, got {p!r}")
        self.every_n_steps = _positive_int("every_n_steps", every_n_steps)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"TextSamples: temperature must be a number >= 0 (0: greedy), got {temperature!r}")
        if top_k is not None:
            _positive_int("top_k", top_k)
        if max_context is not None:
            _positive_int("max_context", max_context)
        for name, fn in (("decode", decode), ("encode", encode)):
            if fn is not None and not callable(fn):
                raise ValueError(f"TextSamples: {name} must be callable (token ids <-> text), got {fn!r}")
        if decode is not None and encode is None:
            raise ValueError("TextSamples: decode is given but encode is not; give the tokenizer's encode too "
                             "(text -> token ids), which turns the prompts into ids")
        self.prompts = list(prompts)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.seed = seed
        self.decode = decode if decode is not None else decode_bytes
        self.encode = encode if encode is not None else encode_bytes
        self.custom_tokenizer = decode is not None
        self._custom_encode = encode is not None
        self.max_context = max_context
        self.tag = tag
        self.history: list[tuple[int, list[str]]] = []
        self._prompt_ids: list[list[int]] = []
        self._last_due = 0
        self._warned_no_logger = False

    # ---- Lightning hooks ------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(pl_module, PipelineModule):
            raise TypeError(f"TextSamples needs a PipelineModule (models.GPT, models.Llama, ...), got "
                            f"{type(pl_module).__name__}")
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is not None and not self.custom_tokenizer:
            # The data's own tokenizer; no special tokens (a BOS) around the prompts, as around the documents.
            self.decode = tokenizer.decode
            if not self._custom_encode:
                self.encode = functools.partial(tokenizer.encode, add_special_tokens=False)
            self.custom_tokenizer = True
        self._encode_prompts(pl_module)

    def _encode_prompts(self, pl_module: PipelineModule) -> None:
        vocab = model_vocab_size(pl_module)  # hparams or, for the adapters, their configs
        if not self.custom_tokenizer and vocab is not None and vocab > BYTE_VOCAB:
            raise ValueError(f"TextSamples: the model's vocabulary has {vocab} tokens, but the default decoding is "
                             f"bytes (at most {BYTE_VOCAB}); give the data module a tokenizer "
                             f"(TextDataModule(tokenizer=...)) or pass the tokenizer's decode and encode")
        self._prompt_ids = []
        for i, prompt in enumerate(self.prompts):
            encoded = self.encode(prompt)
            ids = [int(t) for t in getattr(encoded, "ids", encoded)]  # a tokenizers.Encoding carries .ids
            if not ids:
                raise ValueError(f"TextSamples: prompts[{i}] ({prompt!r}) encodes to no tokens")
            if vocab is not None and not all(0 <= t < vocab for t in ids):
                raise ValueError(f"TextSamples: prompts[{i}] ({prompt!r}) encodes to ids outside the model's "
                                 f"vocabulary of {vocab}: {ids}")
            self._prompt_ids.append(ids)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # Every rank sees the same global step, so every stage makes the same predict calls.
        due = trainer.global_step // self.every_n_steps
        if trainer.state.fn == "fit":
            if due <= self._last_due:
                return
            self._last_due = due
        continuations = self.generate(pl_module)
        if continuations is None:
            return
        self.history.append((trainer.global_step, continuations))
        if trainer.is_global_zero:
            self._log(trainer, continuations)

    @property
    def state_key(self) -> str:
        # Several TextSamples (e.g. greedy and sampled) may run side by side, each under its own tag.
        return self._generate_state_key(tag=self.tag)

    def state_dict(self) -> dict[str, Any]:
        return {"last_due": self._last_due}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_due = int(state_dict.get("last_due", 0))

    # ---- generation --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, pl_module: PipelineModule) -> Optional[list[str]]:
        """Each prompt's continuation (decoded), or ``None`` on a stage that does not see the logits.

        Under a pipeline every stage must call this together: each new token is one ``predict`` call."""
        if not self._prompt_ids:
            self._encode_prompts(pl_module)
        executor = pl_module._pipeline_executor
        max_context = self.max_context or pl_module.hparams.get("max_seq_len") or pl_module.hparams.get("block_size")
        generator = torch.Generator().manual_seed(self.seed) if self.temperature > 0 else None
        device = pl_module.device
        continuations: list[list[int]] = []
        picks_tokens = True
        for prompt in self._prompt_ids:
            ids = torch.tensor([prompt], dtype=torch.long, device=device)
            for _ in range(self.max_new_tokens):
                context = ids if max_context is None else ids[:, -max_context:]
                # (1, T + 1): the model reads all but the last column, so the appended column is never read.
                batch = torch.cat([context, context[:, -1:]], dim=1)
                logits = pl_module.pipeline_forward(batch) if executor is None else executor.predict(batch)
                if logits is None:  # not this pipeline's first stage: it only passes activations on
                    picks_tokens = False
                    # It reads no token, but its batches must keep the first stage's shapes (each shape's
                    # message layout is agreed once): a placeholder column stands for the token picked there.
                    ids = torch.cat([ids, ids[:, -1:]], dim=1)
                    continue
                ids = torch.cat([ids, self._pick(logits, context, generator).to(device)], dim=1)
            continuations.append(ids[0, len(prompt):].tolist())
        return [self.decode(c) for c in continuations] if picks_tokens else None

    def _pick(self, logits: Any, context: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != context.shape:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"TextSamples needs logits of shape (1, {context.shape[1]}, vocab) for a context of "
                f"{context.shape[1]} tokens, got {shape}; the model must read batch[:, :-1] of a (B, T + 1) batch "
                f"and return (B, T, vocab) logits"
            )
        last = logits[:, -1].float()
        if self.temperature == 0:
            return last.argmax(dim=-1, keepdim=True)
        last = last / self.temperature
        if self.top_k is not None and self.top_k < last.shape[-1]:
            kth = torch.topk(last, self.top_k, dim=-1).values[:, -1:]
            last = last.masked_fill(last < kth, float("-inf"))
        probs = torch.softmax(last, dim=-1).cpu()
        return torch.multinomial(probs, 1, generator=generator)

    # ---- logging -------------------------------------------------------------------------------------------------
    def _log(self, trainer: Trainer, continuations: list[str]) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            if not self._warned_no_logger:
                rank_zero_warn("TextSamples writes to a TensorBoardLogger and the trainer has none; the samples are "
                               "only kept in TextSamples.history")
                self._warned_no_logger = True
            return
        for logger in loggers:
            for i, (prompt, continuation) in enumerate(zip(self.prompts, continuations)):
                logger.experiment.add_text(f"{self.tag}/{i}", as_markdown(prompt, continuation), trainer.global_step)


def as_markdown(prompt: str, continuation: str) -> str:
    """TensorBoard renders text as Markdown: an indented block keeps code and line breaks as they are; the prompt
    is shown above the continuation."""
    def block(text: str) -> str:
        return "\n".join("    " + line for line in text.split("\n"))

    return f"**prompt**\n\n{block(prompt)}\n\n**continuation**\n\n{block(continuation)}"
