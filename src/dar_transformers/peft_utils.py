# SPDX-License-Identifier: Apache-2.0
"""PEFT integration: default target modules for model_type "dar", and a LoRA config that can train DAR too.

PEFT picks default target modules by `config.model_type` from its `TRANSFORMERS_MODELS_TO_*_MAPPING` tables
(`peft/utils/constants.py`; LoRA reads its table in `LoraModel._prepare_adapter_config`). DAR keeps Llama's
module names (`q_proj`, `v_proj`, `down_proj`, `input_layernorm`, ...), so every Llama default applies as is:
`register_peft_defaults()` copies each table's "llama" entry to "dar". The package calls it once at import, so
`get_peft_model(dar_model, LoraConfig(task_type="CAUSAL_LM"))` works without listing target modules. Where the
package is not imported (a checkpoint loaded with `trust_remote_code=True`), run the same one-liner:

    peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["dar"] = ["q_proj", "v_proj"]

(and the same for "dar_moe", whose attention keeps those names too).

The DAR residual parameters are not adapted by LoRA (they are `nn.Parameter`s, not linear layers; PEFT's LoRA on
parameters, `target_parameters`, acts in the wrapped module's forward, which the optimised backends never call, so
the model refuses it: `modeling_dar.refuse_forward_only_adapters`). To train them fully next to the adapters, list
their modules in `modules_to_save` (`dar_lora_config(train_dar=True)`):
PEFT then trains and saves a copy of each `attn_residual`, `mlp_residual` and `final_readout`, and
`merge_and_unload()` puts the trained copies back in place.
"""

import importlib.util
import re

from transformers.utils import logging

from .training import DAR_MODULE_NAMES

logger = logging.get_logger(__name__)

MAPPING_SOURCE_MODEL_TYPE = "llama"


def register_peft_defaults(model_type: str = "dar", like: str = MAPPING_SOURCE_MODEL_TYPE) -> list[str]:
    """Give `model_type` the PEFT defaults of `like` in every PEFT target-module table; idempotent.

    Returns the names of the tables that gained an entry. Entries already present are left alone, so a user's
    own registration wins. Does nothing (returns []) when PEFT is not installed.
    """
    if importlib.util.find_spec("peft") is None:
        return []
    from peft.utils import constants

    registered = []
    for table_name in sorted(vars(constants)):
        table = getattr(constants, table_name)
        if (
            table_name.startswith("TRANSFORMERS_MODELS_TO_")
            and isinstance(table, dict)
            and like in table
            and model_type not in table
        ):
            value = table[like]
            table[model_type] = list(value) if isinstance(value, list) else value
            registered.append(table_name)
    if _register_adaption_prompt(model_type, like):
        registered.append("adaption_prompt.TRANSFORMERS_MODEL_CONFIG")
    if registered:
        logger.debug(f"PEFT defaults of {like!r} registered for model_type {model_type!r} in {registered}")
    return registered


def _register_adaption_prompt(model_type: str, like: str) -> bool:
    """Give `model_type` the adaption prompt's (LLaMA-Adapter's) entry of `like`: PEFT keeps it in a table of its
    own, keyed by model type (`peft/tuners/adaption_prompt/config.py`), and refused "dar" ("Unsupported model type for
    adaption prompt"). Its queries are recomputed as Llama's attention computes them, which holds for DAR's Llama,
    Mistral and Qwen2 branches (Qwen2's q_proj carries its bias); Qwen3's attention normalises the queries per head
    (`q_norm`), which that recomputation leaves out, so such a model is refused by name. False where PEFT has no
    such table, or it has an entry already."""
    try:
        from peft.tuners.adaption_prompt import config as adaption_prompt
    except ImportError:
        return False
    table = getattr(adaption_prompt, "TRANSFORMERS_MODEL_CONFIG", None)
    if not isinstance(table, dict) or like not in table or model_type in table:
        return False
    llama_query_states = table[like].compute_query_states

    def query_states(model, **kwargs):
        if getattr(model, "q_norm", None) is not None:
            raise ValueError(
                f"PEFT's adaption prompt recomputes an attention's queries as {like!r} computes them, without the "
                f"per-head query norm (q_norm) of this {model_type} model's {type(model).__name__}: its adapter would "
                "attend with other queries than the model's. Use LoRA (get_peft_model with a LoraConfig) instead."
            )
        return llama_query_states(model, **kwargs)

    table[model_type] = table[like]._replace(compute_query_states=query_states)
    return True


# The modules inside each DAR residual module (`DAR_MODULE_NAMES`), by their path from it.
DAR_INNER_MODULES = ("depth_attention", "depth_attention.key_norm", "read_gate", "write_gate")
# Names PEFT matches (as suffixes of module paths) to a module that holds DAR residual modules: the model, its layer
# list, a decoder layer ("layers.1", "model.layers.0", "0").
DAR_HOLDERS = re.compile(r"(?:.*\.)?model(?:\.layers(?:\.\d+)?)?|(?:.*\.)?layers(?:\.\d+)?|\d+")


def check_modules_to_save(modules_to_save, train_dar: bool) -> None:
    """A `modules_to_save` entry that PEFT would also match inside DAR's residual modules: PEFT matches these names
    as plain suffixes of module paths, so "gate" (DAR-MoE's router, `mlp.gate`) also wraps every `read_gate` and
    `write_gate` and trains them fully. With `train_dar` (the residual modules wrapped too) the nested copies leave an
    adapter that saves but cannot be loaded back (PEFT's KeyError on a `read_gate` parameter): refused; without it,
    a warning names what the entry also matches. An entry that names a holder of DAR's residual modules (a decoder
    layer: "layers.1") nests them the other way round: refused with `train_dar`."""
    for entry in modules_to_save or ():
        if not isinstance(entry, str) or entry in DAR_MODULE_NAMES:
            continue
        if train_dar and DAR_HOLDERS.fullmatch(entry):
            raise ValueError(
                f"modules_to_save entry {entry!r} names a module that holds DAR's residual modules, which "
                "train_dar=True saves on their own: the copies nested in its copy give an adapter that saves but "
                "cannot be loaded back (PEFT's KeyError, as for any nested modules_to_save). Either leave out "
                "train_dar (the entry trains the DAR modules inside it fully) or name the layer's own modules."
            )
        inside = [f"{owner}.{inner}" for owner in DAR_MODULE_NAMES for inner in DAR_INNER_MODULES
                  if f"{owner}.{inner}".endswith(entry)]
        if not inside:
            continue
        message = (
            f"modules_to_save entry {entry!r} also matches DAR's own modules ({', '.join(inside[:3])}, ...): PEFT "
            "matches these names as suffixes of module paths. Name what you mean by more of its path (DAR-MoE's "
            "router: 'mlp.gate')"
        )
        if train_dar:
            raise ValueError(f"{message}; with train_dar=True the residual modules holding them are saved already, and "
                             "the nested copies would give an adapter that cannot be loaded back.")
        logger.warning(f"{message}; as given, those DAR modules are trained fully and saved with the adapter.")


def dar_lora_config(train_dar: bool = False, **lora_kwargs):
    """A `peft.LoraConfig` for causal LM on a DAR model: default target modules (those of Llama) unless given,
    and with `train_dar=True` the DAR residual modules in `modules_to_save` (fully trained and saved). A
    `modules_to_save` entry that would also match modules inside DAR's residual modules is refused with `train_dar`,
    named in a warning without it (`check_modules_to_save`)."""
    from peft import LoraConfig

    lora_kwargs.setdefault("task_type", "CAUSAL_LM")
    check_modules_to_save(lora_kwargs.get("modules_to_save"), train_dar)
    if train_dar:
        modules_to_save = list(lora_kwargs.pop("modules_to_save", None) or [])
        lora_kwargs["modules_to_save"] = modules_to_save + [name for name in DAR_MODULE_NAMES if name not in modules_to_save]
    return LoraConfig(**lora_kwargs)


__all__ = ["check_modules_to_save", "dar_lora_config", "register_peft_defaults"]
