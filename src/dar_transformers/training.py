# SPDX-License-Identifier: Apache-2.0
"""Training helpers for DAR models: the optimiser-group policy of DESIGN.md section 4, ready for `Trainer`.

DAR adds a few small parameters per branch (pseudo-queries w, key-norm weights gamma, read-gate logits a,
write-gate logits b, transport logits r), all under modules named `attn_residual`, `mlp_residual` and
`final_readout`. They are gates and queries, not weights: decaying them towards zero pulls the model away from
the upcycled point (zero queries are uniform depth weights, but zero write-gate logits undo the anti-symmetric
init), so they get their own optimiser group with no weight decay and, optionally, their own learning rate.
They stay float32 when the rest of the model is cast to half precision.

Two ways to plug this into `Trainer`, neither needs a subclass:

    trainer = Trainer(model, args, ..., optimizers=create_dar_optimizer(model, args, dar_learning_rate=1e-3))
    trainer = Trainer(model, args, ..., optimizer_cls_and_kwargs=dar_optimizer_cls_and_kwargs(args, 1e-3))

The second builds the optimiser inside `Trainer.create_optimizer`, after the model has been wrapped, which is
what sharded training (FSDP) needs.
"""

import torch
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_pt_utils import get_parameter_names
from transformers.utils import logging

from .modeling_dar import DAR_MODULE_NAMES

logger = logging.get_logger(__name__)


# The no-decay name patterns of `Trainer.get_decay_parameter_names` (transformers 5.23, trainer.py): biases and
# norms are not decayed, as in the Trainer's own default.
NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def is_dar_parameter(name: str) -> bool:
    """True for a parameter name under a DAR module (also inside PEFT or DDP wrappers, which only add prefixes)."""
    return any(part in DAR_MODULE_NAMES for part in name.split("."))


HALF_DTYPES = (torch.bfloat16, torch.float16)  # what a blanket `model.to(...)` rounds DAR's parameters to


def dar_parameter_names(model: nn.Module) -> list[str]:
    """Names of the DAR parameters of `model`, in `named_parameters` order."""
    return [name for name, _ in model.named_parameters() if is_dar_parameter(name)]


def keep_dar_parameters_fp32(model: nn.Module) -> int:
    """Cast the DAR parameters back to float32 after a blanket `model.to(half_dtype)`; returns how many changed.

    `from_pretrained(..., dtype=torch.bfloat16)` already keeps them float32 (`_keep_in_fp32_modules_strict`);
    this is for models cast by hand. The DAR mixing runs in float32 regardless, so this only matters for the
    precision of the parameters and their optimiser updates.
    """
    changed = 0
    for name, parameter in model.named_parameters():  # float64 (a float64 model's) is left as it is
        if is_dar_parameter(name) and parameter.dtype in HALF_DTYPES:
            parameter.data = parameter.data.float()
            changed += 1
    return changed


def dar_parameter_groups(
    model: nn.Module,
    learning_rate: float,
    weight_decay: float,
    dar_learning_rate: float | None = None,
) -> list[dict]:
    """Optimiser parameter groups: decayed weights, undecayed biases/norms, and the DAR parameters.

    The DAR group has `weight_decay=0` and `lr=dar_learning_rate` (default: `learning_rate`). Only parameters
    with `requires_grad` are included, so a PEFT model with frozen DAR parameters gets no DAR group; empty groups
    are dropped. Every group carries a `"name"` key for logging. Raises if a trainable DAR parameter is not
    float32 or float64 (call `keep_dar_parameters_fp32` first) or if the model has no trainable parameter at all.
    """
    if learning_rate <= 0 or (dar_learning_rate is not None and dar_learning_rate <= 0):
        raise ValueError(f"learning rates must be positive, got {learning_rate=} and {dar_learning_rate=}.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
    decayed_names = set(get_parameter_names(model, [nn.LayerNorm], NO_DECAY_NAME_PATTERNS))
    groups = {
        "decay": {"params": [], "weight_decay": weight_decay, "lr": learning_rate},
        "no_decay": {"params": [], "weight_decay": 0.0, "lr": learning_rate},
        "dar": {"params": [], "weight_decay": 0.0, "lr": dar_learning_rate or learning_rate},
    }
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if is_dar_parameter(name):
            if parameter.dtype in HALF_DTYPES:  # float32, or float64 in a float64 model (the package's policy)
                raise ValueError(
                    f"DAR parameter {name} is {parameter.dtype}; DAR parameters must stay float32 (float64 in a "
                    "float64 model): call dar_transformers.training.keep_dar_parameters_fp32(model) after casting "
                    "the model."
                )
            groups["dar"]["params"].append(parameter)
        elif name in decayed_names:
            groups["decay"]["params"].append(parameter)
        else:
            groups["no_decay"]["params"].append(parameter)
    result = [{"name": name, **group} for name, group in groups.items() if group["params"]]
    if not result:
        raise ValueError("The model has no trainable parameters.")
    logger.info(
        "DAR optimiser groups: "
        + ", ".join(f"{group['name']}={len(group['params'])} (lr {group['lr']}, wd {group['weight_decay']})" for group in result)
    )
    return result


# Keyword arguments of `Trainer.get_optimizer_cls_and_kwargs` that mean the optimiser builds its own parameter groups
# (GaLore, APOLLO, LOMO, layer-wise optimisers), where DAR's groups cannot go.
OWN_GROUP_KWARGS = ("params", "model", "optimizer_dict")


def trainer_optimizer(args: TrainingArguments, model: nn.Module | None = None) -> tuple[type, dict]:
    """The optimiser class and keyword arguments (learning rate left out) that `Trainer` builds from `args.optim` and
    `args.optim_args` (AdamW, fused or not, by default; SGD, Adafactor, ...), for DAR's parameter groups."""
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    own = [key for key in OWN_GROUP_KWARGS if key in kwargs]
    if own:
        name = getattr(args.optim, "value", args.optim)  # an `OptimizerNames` member, or a string
        raise ValueError(
            f"TrainingArguments.optim={name!r} builds its own parameter groups ({', '.join(own)}), so "
            "DAR's optimiser groups (no weight decay on DAR's parameters) cannot be given to it: choose an optimiser "
            "over parameter groups (adamw_torch, adamw_torch_fused, sgd, adafactor, ...) or pass optimizer_class."
        )
    kwargs = dict(kwargs)
    kwargs.pop("lr", None)
    return optimizer_class, kwargs


def create_dar_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    dar_learning_rate: float | None = None,
    optimizer_class: type[torch.optim.Optimizer] | None = None,
    **optimizer_kwargs,
) -> tuple[torch.optim.Optimizer, None]:
    """`(optimizer, None)` for `Trainer(optimizers=...)`: the Trainer still builds its usual LR scheduler.

    Learning rate and weight decay come from `args`; so does the optimiser unless `optimizer_class` is given: the one
    `Trainer` builds from `args.optim` and `args.optim_args` (`trainer_optimizer`), with `optimizer_kwargs` over its
    settings (a named AdamW takes its betas and epsilon from `args` too). The scheduler scales every group's own
    learning rate by the same factor.
    """
    if optimizer_class is None:
        optimizer_class, settings = trainer_optimizer(args, model)
        optimizer_kwargs = {**settings, **optimizer_kwargs}
    elif optimizer_class is torch.optim.AdamW:  # named: its betas and epsilon from `args`, as Trainer's AdamW
        optimizer_kwargs = {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, **optimizer_kwargs}
    groups = dar_parameter_groups(model, args.learning_rate, args.weight_decay, dar_learning_rate)
    return optimizer_class(groups, lr=args.learning_rate, **optimizer_kwargs), None


class DAROptimizerFactory:
    """An optimiser factory for `Trainer(optimizer_cls_and_kwargs=(DAROptimizerFactory, kwargs))`.

    `Trainer.create_optimizer` treats a non-`Optimizer` class as a factory: it instantiates it and calls it with
    the (possibly wrapped) model and `kwargs`. `kwargs` are `learning_rate`, `weight_decay`, optional
    `dar_learning_rate` and `optimizer_class`, and the optimiser's own keyword arguments.
    """

    def __call__(
        self,
        model: nn.Module,
        learning_rate: float,
        weight_decay: float,
        dar_learning_rate: float | None = None,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **optimizer_kwargs,
    ) -> torch.optim.Optimizer:
        groups = dar_parameter_groups(model, learning_rate, weight_decay, dar_learning_rate)
        return optimizer_class(groups, lr=learning_rate, **optimizer_kwargs)


def dar_optimizer_cls_and_kwargs(
    args: TrainingArguments, dar_learning_rate: float | None = None
) -> tuple[type[DAROptimizerFactory], dict]:
    """`(DAROptimizerFactory, kwargs)` for `Trainer(optimizer_cls_and_kwargs=...)`: the optimiser `Trainer` builds
    from `args.optim` and `args.optim_args` (`trainer_optimizer`) over DAR's parameter groups."""
    optimizer_class, settings = trainer_optimizer(args)
    kwargs = {"learning_rate": args.learning_rate, "weight_decay": args.weight_decay,
              "optimizer_class": optimizer_class, **settings}
    return DAROptimizerFactory, {**kwargs, "dar_learning_rate": dar_learning_rate}


__all__ = [
    "DAR_MODULE_NAMES",
    "is_dar_parameter",
    "dar_parameter_names",
    "keep_dar_parameters_fp32",
    "dar_parameter_groups",
    "create_dar_optimizer",
    "trainer_optimizer",
    "DAROptimizerFactory",
    "dar_optimizer_cls_and_kwargs",
]
