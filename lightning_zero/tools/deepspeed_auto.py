"""HF Trainer's ``"auto"`` in a DeepSpeed config, resolved as HF resolves it (``deepspeed_config.py`` uses it);
and the value checks every ``deepspeed_*`` module shares (what sets nothing, unknown keys, positive ints).

HF's ``HfTrainerDeepSpeedConfig.trainer_config_process`` fills each "auto" from the ``TrainingArguments`` beside
the config (clipping from ``max_grad_norm``, weight decay from ``weight_decay``, precision from ``--bf16``, the
bucket sizes from the model's ``hidden_size``). Here the values come from ``auto=`` by the same names; a key
without one is left to the setting beside it (a Trainer flag, or the recipe's field), never DeepSpeed's default.
"""

from __future__ import annotations

from typing import Any, Optional


def unset(v) -> bool:
    """A DeepSpeed value that sets nothing: absent, null, or HF's "auto" placeholder."""
    return v is None or v == "auto"


def setting(block: dict, key: str, default: Any) -> Any:
    """``block[key]``, or DeepSpeed's ``default`` where the config sets nothing (:func:`unset`)."""
    value = block.get(key)
    return default if unset(value) else value


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config setting that has no equivalent here (the message names what is allowed)."""


def check_keys(block: dict, allowed: set, where: str) -> None:
    """One error naming a block's unknown keys and the allowed ones (every deepspeed_* module's check)."""
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where}: unsupported key(s) {unknown}. Allowed: {', '.join(sorted(allowed))}.")


def positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeepSpeedConfigError(f"DeepSpeed config {where}={value!r}: allowed a positive integer (or \"auto\").")
    return value


# "auto" key -> (HF TrainingArguments name it resolves from, the recipe field that then stays in force)
AUTO_SOURCES = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", "data.batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "trainer.accumulate_grad_batches"),
    "train_batch_size": ("world size x micro-batch x accumulation", None),
    "gradient_clipping": ("max_grad_norm", "trainer.gradient_clip_val"),
    "fp16.enabled": ("precision", "trainer.precision"),
    "bf16.enabled": ("precision", "trainer.precision"),
    "optimizer.params.lr": ("learning_rate", "optim.lr"),
    "optimizer.params.weight_decay": ("weight_decay", "optim.weight_decay"),
    "optimizer.params.betas": ("adam_beta1, adam_beta2", None),
    "optimizer.params.eps": ("adam_epsilon", None),
    "scheduler.params.warmup_min_lr": ("0, as HF fills it", None),
    "scheduler.params.warmup_max_lr": ("learning_rate", "optim.lr"),
    "scheduler.params.warmup_num_steps": ("warmup_steps", "optim.warmup_steps"),
    "scheduler.params.total_num_steps": ("max_steps", "optim.total_steps"),
    "zero_optimization.reduce_bucket_size": ("hidden_size x hidden_size elements", "strategy.bucket_mb"),
    "zero_optimization.stage3_param_persistence_threshold": ("10 x hidden_size", "strategy.persist_numel"),
}


class _Auto:
    """Resolves "auto" values as HF's Trainer does (from ``values``, HF ``TrainingArguments`` names), recording
    each resolution in ``record`` (the translation's ``auto``: key -> what it resolved to)."""

    def __init__(self, values: Optional[dict], record: dict) -> None:
        self.values, self.record = dict(values or {}), record
        unknown = sorted(set(self.values) - {a for a, _ in AUTO_SOURCES.values()} - {
            "adam_beta1", "adam_beta2", "hidden_size"})
        if unknown:
            raise DeepSpeedConfigError(f"auto: unknown name(s) {unknown}. Allowed: HF TrainingArguments names "
                                       "per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm, "
                                       "precision, learning_rate, weight_decay, adam_beta1, adam_beta2, "
                                       "adam_epsilon, warmup_steps, max_steps, hidden_size.")

    def resolve(self, key: str, value: Any, source: Optional[str] = None, compute=None) -> Any:
        """``value`` itself, or for "auto" the resolved value (None: left to the setting beside it)."""
        if value != "auto":
            return value
        name, field_ = AUTO_SOURCES[key]
        source = source or name
        if compute is not None:
            resolved = compute(self.values)
        else:
            resolved = self.values.get(source)
        if resolved is not None:
            self.record[key] = f"{resolved!r} (from {source})"
        else:
            self.record[key] = (f"left to the recipe's {field_}" if field_ else f"HF derives it from {name}; "
                                  "left to the setting beside it")
        return resolved
