"""LightningModule for T5 fine-tuning (offline; random init or a *local* checkpoint).

Design note: the model is built from a ``T5Config`` so that nothing is fetched at
run time; ``pretrained`` only accepts a local directory.  Validation computes
loss + token accuracy on every batch and runs ``generate`` for text metrics on every batch, or on the
first ``num_gen_batches`` only when set (testing generates for every batch) (chrF, SacreBLEU, ROUGE-L --
all pure-python in torchmetrics, no nltk/sacrebleu download needed as long as
``rougeLsum`` and the stemmer stay off).  Generation passes ``synced_gpus=True``
under multi-process runs so ranks whose sequences finish early keep doing
forwards: required with ZeRO-3, where every forward gathers shards collectively.
The first ``num_samples`` validation examples are shown as text at every validation (TensorBoard +
``samples.jsonl``); a test run writes every prediction to ``predictions_path`` (t5_samples.py).
"""
from __future__ import annotations

import contextlib

import math
import os
from pathlib import Path
from typing import Any

# Must be set before transformers is imported: never touch the HF hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402
from torchmetrics.text import CHRFScore, SacreBLEUScore  # noqa: E402
from torchmetrics.text.rouge import ROUGEScore  # noqa: E402
from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration  # noqa: E402

from t5_attention import ATTENTIONS  # noqa: E402
from t5_optim import MANUAL, OPTIMIZERS, make_muon_adamw, make_optimizer  # noqa: E402
from t5_samples import append_jsonl, gather_rows, markdown_table, write_jsonl  # noqa: E402
from t5_tokenizer import bytes_tokenizer, check_vocab_matches, tokenizer_vocab  # noqa: E402

from lightning_zero import load_pretrained  # noqa: E402
# one table for recipe and estimator; preset_name: ours or HF's spelling
from lightning_zero.tools.t5_dims import T5_PRESETS, preset_name  # noqa: E402,F401


LR_SCHEDULES = ("linear", "cosine", "inverse_sqrt")


def make_t5_config(preset: str = "t5_tiny", tokenizer: Any = None, **overrides: Any) -> T5Config:
    """T5Config from a preset; special ids (and vocab for small tokenizers) come from `tokenizer`."""
    cfg = dict(T5_PRESETS[preset_name(preset)], feed_forward_proj="relu", tie_word_embeddings=True)  # t5-3b too
    if tokenizer is not None:
        # T5 convention: decoder starts from the pad id.  The recipe's tokenizer (a trained BPE or bytes)
        # sizes the embedding, whatever vocabulary the preset's original checkpoint had.
        cfg.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   decoder_start_token_id=tokenizer.pad_token_id, vocab_size=tokenizer_vocab(tokenizer))
    else:
        cfg.update(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    cfg.update(overrides)
    return T5Config(**cfg)


def check_local_model_dir(path: str) -> Path:
    p = Path(path).expanduser()
    if not (p.is_dir() and (p / "config.json").is_file()):
        raise FileNotFoundError(
            f"pretrained={path!r} is not a local model directory (need config.json + weights). "
            "Weights are never downloaded at run time: on a machine with network access run "
            "`T5ForConditionalGeneration.from_pretrained('t5-small').save_pretrained('/some/dir')` and the same "
            "with AutoTokenizer (the run uses the directory's own tokenizer) "
            "(or copy a HF cache snapshot dir), then pass pretrained='/some/dir'.")
    return p


def _on_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _to_cpu(model: T5ForConditionalGeneration) -> None:
    model.to_empty(device="cpu")  # storage, no values; every module gets its own tensors ...
    model.tie_weights()  # ... so the embeddings are tied again


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class T5FineTuner(L.LightningModule):
    def __init__(self, preset: str = "t5_tiny", tokenizer: Any = None, pretrained: str | None = None,
                 lr: float = 1e-3, weight_decay: float = 0.01, warmup_steps: int = 100,
                 total_steps: int | None = None, num_gen_batches: int | None = None, max_new_tokens: int = 64,
                 dropout_rate: float = 0.1, no_repeat_ngram_size: int = 0, num_samples: int = 4,
                 samples_path: str | None = None,
                 predictions_path: str | None = None, model_config: dict | None = None,
                 label_smoothing: float = 0.0, lr_schedule: str = "linear",
                 attention: str = "dense", sparse_attention: dict | None = None,
                 optimizer: str = "adamw", freeze_step: int | None = None, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 gradient_clip_val: float | None = None, accumulate_grad_batches: int = 1,
                 **config_overrides: Any):
        """``gradient_clip_val`` / ``accumulate_grad_batches``: the clipping and accumulation of an ``optimizer``
        in ``t5_optim.MANUAL`` (which steps itself); the Trainer's clip and accumulate every other choice."""
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optim.name={optimizer!r}: allowed {', '.join(OPTIMIZERS)}.")
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.schedule={lr_schedule!r}: allowed {', '.join(LR_SCHEDULES)}.")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"optim.label_smoothing={label_smoothing}: allowed 0 <= value < 1.")
        # The tokenizer object is not a hyperparameter (not serialisable in general).
        self.save_hyperparameters(ignore=["tokenizer"])
        self.automatic_optimization = optimizer not in MANUAL
        self.tokenizer = tokenizer if tokenizer is not None else bytes_tokenizer()
        if model_config is not None:  # load_from_checkpoint: the architecture as saved; the weights follow
            self.model = T5ForConditionalGeneration(T5Config(**model_config))
            check_vocab_matches(self.tokenizer, self.model.config.vocab_size, "the checkpoint's model_config")
        elif pretrained:
            # on the meta device (nothing allocated, no init): under ZeRO-3 each rank then reads only the slices it
            # keeps from the checkpoint (lightning_zero.load_pretrained); other strategies: filled in configure_model
            self._pretrained = str(check_local_model_dir(pretrained))
            config = T5Config.from_pretrained(self._pretrained, local_files_only=True)
            check_vocab_matches(self.tokenizer, config.vocab_size, f"model.pretrained={pretrained}")
            with torch.device("meta"):
                self.model = T5ForConditionalGeneration(config)
            load_pretrained(self.model, self._pretrained)
            if (Path(self._pretrained) / "generation_config.json").is_file():  # as from_pretrained reads it
                self.model.generation_config = GenerationConfig.from_pretrained(self._pretrained)
        else:
            config = make_t5_config(preset, self.tokenizer, dropout_rate=dropout_rate, **config_overrides)
            self.model = T5ForConditionalGeneration(config)
        if attention not in ATTENTIONS:
            raise ValueError(f"model.attention={attention!r}: allowed {', '.join(ATTENTIONS)}.")
        if attention == "sparse":
            # in place, before any strategy sees the model: stage-3 units are still the T5 blocks, the state
            # dict keeps its keys, and load_from_checkpoint swaps again from the saved hyper-parameters
            from lightning_zero.sparse_attention import sparsify_t5_encoder

            sparsify_t5_encoder(self.model, **(sparse_attention or {}))
        # The checkpoint carries the architecture: `lightning-zero export --hf` writes config.json from it and
        # load_from_checkpoint rebuilds the same model (no preset table, no pretrained directory needed).
        self.hparams["model_config"] = self.model.config.to_dict()
        tok = self.tokenizer
        # generate() reads generation_config, not config: keep the special ids consistent.
        gc = self.model.generation_config
        gc.pad_token_id, gc.eos_token_id = tok.pad_token_id, tok.eos_token_id
        gc.decoder_start_token_id = self.model.config.decoder_start_token_id
        if gc.decoder_start_token_id is None:
            gc.decoder_start_token_id = self.model.config.decoder_start_token_id = tok.pad_token_id
        vocab = self.model.config.vocab_size
        self.val_acc = MulticlassAccuracy(num_classes=vocab, ignore_index=-100, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=vocab, ignore_index=-100, average="micro")
        self.chrf = CHRFScore()
        self.bleu = SacreBLEUScore()  # default "13a" tokenizer: pure python, no sacrebleu pkg
        self.rouge = ROUGEScore(rouge_keys=("rougeL",))  # rougeLsum/stemmer would need nltk
        self._generated = False
        self._rows: list[dict] = []  # samples (validation) or predictions (test) of this rank

    def configure_model(self) -> None:
        """``model.pretrained`` under a strategy that does not partition a meta model (DDP, ZeRO 0-2): the
        weights are read now, whole, on every rank."""
        if _on_meta(self.model) and getattr(self.trainer.strategy, "stage", None) != 3:
            _to_cpu(self.model)
            load_pretrained(self.model, self._pretrained)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        # the main process of a fork/spawn fit never ran configure_model: its meta model takes the weights
        # rank 0 sends back (Lightning loads them into this module) once it has storage
        if _on_meta(self.model):
            _to_cpu(self.model)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    @staticmethod
    def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k != "index"}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**self._inputs(batch))
        loss = out.loss
        if self.hparams.label_smoothing > 0:  # training loss only: val/test loss stay the plain NLL
            loss = torch.nn.functional.cross_entropy(
                out.logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                label_smoothing=self.hparams.label_smoothing)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        if not self.automatic_optimization:
            self._manual_step(loss, batch_idx)
        return loss

    def _manual_step(self, loss: torch.Tensor, batch_idx: int) -> None:
        """Muon + AdamW (``optim.name=muon``) with manual optimization, where Lightning neither accumulates nor
        clips: ``accumulate_grad_batches`` micro-batches of ``loss / N`` (the ones before the last without the
        gradient synchronization, as Lightning's own accumulation does), then DDP's one-line clip across both
        optimizers, ``torch.nn.utils.clip_grad_norm_(self.parameters(), v)``, which lightning_zero turns into its
        global norm over every rank's shards, then both steps and both LR schedules.
        Muon's step goes through Lightning's optimizer wrapper, which counts it (``trainer.global_step``,
        ``max_steps``, checkpoints); AdamW's is the strategy's own ``optimizer_step``, because Lightning counts
        every wrapper's step and ``trainer.max_steps`` would then be half as many batches as with adamw."""
        n = self.hparams.accumulate_grad_batches
        last = (batch_idx + 1) % n == 0 or self.trainer.is_last_batch
        with contextlib.nullcontext() if last else self.trainer.strategy.block_backward_sync():
            self.manual_backward(loss / n)
        if not last:
            return
        muon, adamw = self.optimizers()
        if self.hparams.gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.hparams.gradient_clip_val)
        muon.step()
        self.trainer.strategy.optimizer_step(adamw.optimizer, closure=lambda: None, model=self)
        muon.zero_grad()
        adamw.zero_grad()
        for sched in self.lr_schedulers():
            sched.step()

    def _generate(self, batch: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        # ZeRO-3: hold the whole model once for the generate() call instead of gathering every unit at
        # every decoding step; no collective runs inside, so ranks may stop at different lengths
        gathered = getattr(self.trainer.strategy, "gathered_params", contextlib.nullcontext)
        with gathered():
            gen = self.model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      max_new_tokens=self.hparams.max_new_tokens, do_sample=False, num_beams=1,
                                      no_repeat_ngram_size=self.hparams.no_repeat_ngram_size,
                                      synced_gpus=_world_size() > 1 and gathered is contextlib.nullcontext)
        preds = self.tokenizer.batch_decode(gen.tolist(), skip_special_tokens=True)
        refs = self.tokenizer.batch_decode(
            [[t for t in row if t != -100] for row in batch["labels"].tolist()], skip_special_tokens=True)
        preds, refs = [p.strip() for p in preds], [r.strip() for r in refs]
        self.chrf.update(preds, [[r] for r in refs])
        self.bleu.update(preds, [[r] for r in refs])
        self.rouge.update(preds, refs)
        self._generated = True
        return preds, refs

    def _rows_of(self, batch: dict[str, torch.Tensor], preds: list[str], refs: list[str],
                 keep: int | None = None) -> list[dict]:
        idx = batch["index"].tolist() if "index" in batch else [-1] * len(preds)
        srcs = self.tokenizer.batch_decode(batch["input_ids"].tolist(), skip_special_tokens=True)
        return [{"index": i, "source": s, "reference": r, "prediction": p}
                for i, s, r, p in zip(idx, srcs, refs, preds) if keep is None or 0 <= i < keep]

    def _eval_step(self, batch: dict[str, torch.Tensor], prefix: str, acc: MulticlassAccuracy) -> None:
        out = self.model(**self._inputs(batch))
        labels = batch["labels"]
        self.log(f"{prefix}_loss", out.loss, prog_bar=True, sync_dist=True, batch_size=labels.size(0))
        # argmax first: a (tokens x vocab) float copy for a 32k vocab is wasteful.
        acc.update(out.logits.argmax(-1).flatten(), labels.flatten())
        self.log(f"{prefix}_token_acc", acc, on_step=False, on_epoch=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_acc)
        # Same batch indices on every rank (the DistributedSampler pads ranks to equal
        # length), so all ranks enter generate() together.
        n = self.hparams.num_gen_batches  # None: every batch (data.limit_val already caps the set)
        if n is None or batch_idx < n:
            preds, refs = self._generate(batch)
            self._rows += self._rows_of(batch, preds, refs, keep=self.hparams.num_samples)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_acc)
        preds, refs = self._generate(batch)
        self._rows += self._rows_of(batch, preds, refs)

    def _log_text_metrics(self, prefix: str) -> None:
        # compute() all-gathers metric state, so every rank must call it; `_generated`
        # is identical on all ranks for the reason given in validation_step.
        if self._generated:
            self.log(f"{prefix}_chrf", self.chrf.compute(), sync_dist=True)
            # sacreBLEU's own scale, points 0-100 (torchmetrics returns the fraction)
            self.log(f"{prefix}_sacrebleu", 100 * self.bleu.compute(), sync_dist=True)
            self.log(f"{prefix}_rougeL", self.rouge.compute()["rougeL_fmeasure"], sync_dist=True)
        for m in (self.chrf, self.bleu, self.rouge):
            m.reset()
        self._generated = False

    def on_validation_epoch_end(self) -> None:
        self._log_text_metrics("val")
        rows, self._rows = gather_rows(self._rows), []  # collective: every rank
        if not rows or not self.trainer.is_global_zero or self.trainer.sanity_checking:
            return
        step = self.trainer.global_step
        for lg in self.loggers:
            if hasattr(getattr(lg, "experiment", None), "add_text"):  # TensorBoard (SummaryWriter)
                lg.experiment.add_text("val_samples", markdown_table(rows), global_step=step)
        if self.hparams.samples_path:
            append_jsonl(self.hparams.samples_path, {"step": step, "rows": rows})

    def on_test_epoch_end(self) -> None:
        self._log_text_metrics("test")
        rows, self._rows = gather_rows(self._rows), []
        if self.trainer.is_global_zero and self.hparams.predictions_path:
            write_jsonl(self.hparams.predictions_path, rows)

    def configure_optimizers(self) -> dict[str, Any]:
        # No weight decay on biases and norm scales (T5LayerNorm has only a weight).
        no_decay_ids = set()
        for mod in self.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for pname, p in mod.named_parameters(recurse=False):
                if is_norm or pname == "bias":
                    no_decay_ids.add(id(p))
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if id(p) not in no_decay_ids],
             "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        total = self.hparams.total_steps
        if total is None:
            est = self.trainer.estimated_stepping_batches
            total = int(est) if est is not None and math.isfinite(est) else 10_000
        h = self.hparams
        if h.optimizer in MANUAL:
            opts = make_muon_adamw(self.model, groups, h.lr)  # the HF model: it names its output head
        else:
            opts = [make_optimizer(groups, h.lr, total, h.optimizer, h.freeze_step, h.var_update_scaler,
                                   h.local_step_scaler, h.local_step_clipper)]
        warmup = min(self.hparams.warmup_steps, max(total - 1, 0))

        kind = self.hparams.lr_schedule

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)  # never exactly 0 on the first step
            if kind == "cosine":
                frac = min(1.0, (step - warmup) / max(1, total - warmup))
                return 0.5 * (1.0 + math.cos(math.pi * frac))
            if kind == "inverse_sqrt":  # T5's own schedule: 1/sqrt(step) after warmup, no decay to 0
                return math.sqrt(max(1, warmup) / max(step, 1))
            return max(0.0, (total - step) / max(1, total - warmup))  # linear: the formula runs always had

        if len(opts) == 1:
            sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lr_lambda)
            return {"optimizer": opts[0], "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        scheds = [{"scheduler": torch.optim.lr_scheduler.LambdaLR(o, lr_lambda), "interval": "step"} for o in opts]
        return opts, scheds
