# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Configuration of Dual Attention Residuals (DAR; arXiv 2607.18730) on a Llama-family decoder.

`DARConfig` is `LlamaConfig` plus the typed DAR fields below; every Llama field keeps its meaning, so a Llama
`config.json` plus DAR fields describes a DAR model. Field semantics follow DESIGN.md section 2:

- `dar_block_size` K counts *branches* (attention and MLP are separate branches, M = 2 * num_hidden_layers).
  K = 1 is Full DAR, K = M a single block. `None` picks about 8 blocks (the AttnRes operating point).
- `dar_num_streams` J: 2 is DAR, 1 is Attention Residuals (AttnRes) through the same code path.
- `dar_routing` (key stream, value stream) for target stream j: dar (1-j, j), selfkv (j, j), crossv (j, 1-j),
  fixedkv (0, 1). `None` picks "dar" for two streams and "selfkv" (the only routing) for one.
- `dar_write_mode`: "duplicate" (c = J, eta = 1, every stream starts from the embedding) or "split"
  (c = 1, eta = J, every stream starts from embedding / J).
- `dar_gate_delta`: spread of the anti-symmetric write-gate init (b^0 = +delta xi, b^1 = -delta xi). `None` picks
  0.7, or 0 for fixedkv, which is only exact at delta = 0 (DESIGN.md section 3).
- `dar_rho_init`: initial transport coefficient rho in (0, 1) of the partial-block mixing.
- `dar_include_partial`, `dar_count_scaling`: both True for the exact reduction to the source model; switching
  either off is a documented ablation / negative control.
- `dar_branch_family`: which HF family's attention and MLP modules implement the unchanged branches.
- `sliding_window`: Mistral's attention window (None: full causal attention), read by the Mistral branch and
  by the mask, as in `MistralModel`; kept from the source at conversion so the upcycle stays exact.
- `dar_history_dtype`: the dtype the committed history entries B_0 .. B_{n-1} are stored in: "float32" (the
  precision policy of DESIGN.md section 4, the default: float32, or float64 for a float64 model) or "model" (the
  model's dtype, as Llama keeps its residual stream: bf16 entries for a bf16 model). Either way the partial block
  state, the per-token statistics and the depth softmax and mixing stay float32; only storage changes. "model" needs
  `dar_implementation` "two_phase" or "reference" (the fused "fast" path keeps its buffers in float32).
- `dar_implementation`: the depth backend (`depth_backends.ALL_DEPTH_BACKENDS`): "fast" (the fused eager path; a
  forward traced by `torch.compile` runs "two_phase" instead), "two_phase" (two-phase depth reads, DESIGN.md
  section 7: compiles; keeps no committed entry of a block of one write, so Full DAR's backward is leaner) or
  "reference" (the plain equations, the oracle).
- `dar_compiled_read`: how a training forward traced by `torch.compile` reads the depth history (forwards with
  gradients off are unaffected): "inlined" (the default: each read is plain code that inductor fuses; every block
  compiles kernels of its own, so the first compiled step takes several times Llama's) or "operator" (each read and
  its gradient are one custom operator each, which inductor calls as they are: the first compiled step takes about
  1.7x Llama's (1.5x with `dar_training_kernel="cpp"`, whose C++ kernels the operators then run on CPU), each step
  after it 8-25 % longer than inlined at the SmolLM2 width, or 3-5 % longer with the C++ kernels;
  docs/overhead-log.md).
- `dar_inference_kernel`: how an eager forward with gradients off on CPU runs the depth path of a few tokens
  (decoding): "torch" (the default: a dozen PyTorch operations per branch) or "cpp" (one C++ function per phase 1,
  per read of the partial and per write, `cpu_kernels.py`: built by `torch.utils.cpp_extension` on first use, about
  40 s once per machine, and needing a C++ compiler and ninja; without them a warning, and "torch" runs). Same
  equations either way; training, compiled graphs and other devices are unaffected.
- `dar_training_kernel`: how an eager training forward and backward on CPU with the fused "fast" path run the depth
  path: "torch" (the default: PyTorch operations and hand-written backwards) or "cpp" (each read, forward and
  backward, and each two-stream write, forward and backward, one C++ call over the tokens, reading each token's
  sources once; the same `cpu_kernels.py` extension, built and falling back as above). Same equations and the same
  saved tensors. With `dar_compiled_read="operator"` it also sets what that operator runs on CPU: the C++ read
  (`read_sources`, each read's entries' statistics computed in its pass) instead of PyTorch operations. Inlined
  compiled reads, the other backends and other devices are unaffected.
"""

import difflib
import math
import os
from pathlib import Path
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.utils import logging

DAR_ROUTINGS = ("dar", "selfkv", "crossv", "fixedkv")
DAR_WRITE_MODES = ("duplicate", "split")
DAR_BRANCH_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DAR_IMPLEMENTATIONS = ("fast", "two_phase", "reference")
DAR_HISTORY_DTYPES = ("float32", "model")
DAR_COMPILED_READS = ("inlined", "operator")
DAR_INFERENCE_KERNELS = ("torch", "cpp")
DAR_TRAINING_KERNELS = ("torch", "cpp")
DAR_TARGET_BLOCKS = 8  # AttnRes fixes "about 8 blocks" as the practical operating point.
DAR_DEFAULT_DELTA = 0.7
# The package's model types: DAR and DAR-MoE (`DARMoeConfig`).
DAR_MODEL_TYPES: tuple[str, ...] = ("dar", "dar_moe")
# The code files a DAR-MoE folder holds beyond a dense DAR folder's (`DARMoeConfig.remote_code_auto_map`'s modules).
DAR_MOE_CODE_FILES = frozenset({"configuration_dar_moe", "modeling_dar_moe"})

logger = logging.get_logger(__name__)

# Target stream j -> (key stream, value stream), DESIGN.md section 2 "routing".
ROUTING_KEY_VALUE_STREAMS = {
    "dar": ((1, 0), (0, 1)),
    "selfkv": ((0, 0), (1, 1)),
    "crossv": ((0, 1), (1, 0)),
    "fixedkv": ((0, 1), (0, 1)),
}


def _must_be_one_of(field: str, value, allowed, owner: str = "DARConfig") -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{field} must be one of {list(allowed)}, got {value!r}.")


# The options the depth backends read (with `==`: a typo would be a silent default), with their allowed values.
DAR_BACKEND_OPTIONS = {
    "dar_history_dtype": DAR_HISTORY_DTYPES,
    "dar_compiled_read": DAR_COMPILED_READS,
    "dar_inference_kernel": DAR_INFERENCE_KERNELS,
    "dar_training_kernel": DAR_TRAINING_KERNELS,
}


def check_backend_options(config, owner: str = "DARConfig") -> None:
    """Refuse a backend option outside its allowed values, naming the field as `owner.field`: at construction
    (`validate_dar`) and at every forward (`depth_backends.depth_backend`, "config": a value set on a built model's
    config)."""
    for field, allowed in DAR_BACKEND_OPTIONS.items():
        _must_be_one_of(field, getattr(config, field), allowed, owner)


# The fields a DAR model's modules read when it is built (streams, gates, which branch commits or reads the partial,
# epsilons) and its depth backends read again at each forward: a value changed on a built model's config would have
# the two disagree (`check_layout_unchanged`). The backend options above may change at any forward.
DAR_LAYOUT_FIELDS = ("rms_norm_eps", "dar_num_streams", "dar_block_size", "dar_routing", "dar_write_mode",
                     "dar_include_partial", "dar_count_scaling", "dar_branch_family")


def check_layer_count(config, owner: str) -> None:
    """Refuse a layer count below 1, naming the field as `owner.num_hidden_layers` (else a block size in [1, 0])."""
    layers = config.num_hidden_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{owner}.num_hidden_layers must be a positive integer (DAR mixes the outputs of the decoder "
                         f"layers over depth), got {layers!r}.")


def check_sliding_window(config, owner: str) -> None:
    """Refuse a sliding window that is neither None nor a positive integer, naming it as `owner.sliding_window`."""
    window = config.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{owner}.sliding_window must be None or a positive integer, got {window!r}.")


def check_forward_fields(config) -> None:
    """Refuse, at a forward, values set on a built model's config that its construction refuses (`validate_dar`): a
    layer count below 1 (a prefix of the layers, as `generate(assistant_early_exit=L)` sets it, needs one; 0 failed as
    an IndexError) and a sliding window that is not a positive integer (0 failed in the mask, -2 ran with a wrong
    one)."""
    check_layer_count(config, "config")
    check_sliding_window(config, "config")


def dar_layout(config) -> tuple:
    return tuple(getattr(config, field) for field in DAR_LAYOUT_FIELDS)


def check_layout_unchanged(config, built: tuple) -> None:
    """Refuse a forward whose config's layout fields differ from those the model was built with (`dar_layout`): the
    modules would compute one model and the backends another (wrong values, or an IndexError for a larger block)."""
    now = dar_layout(config)
    if now != built:
        field, was, value = next((f, b, n) for f, b, n in zip(DAR_LAYOUT_FIELDS, built, now) if b != n)
        raise ValueError(
            f"DARConfig.{field} was changed on a built model ({was!r} -> {value!r}); its modules were built for "
            f"{was!r}. Set it back, or build a new model from the changed config."
        )


def refuse_unknown_dar_fields(cls, given) -> None:
    """Refuse names in `given` that look like DAR fields (the `dar_` prefix, this package's) but are none of `cls`'s:
    HF keeps any unknown key as an attribute, so `dar_include_partials` (a typo) in config.json or a keyword loaded a
    model with the field's default and no word said."""
    known = [name for name in cls.__dataclass_fields__ if name.startswith("dar_")]
    unknown = sorted(name for name in given if name.startswith("dar_") and name not in known)
    if unknown:
        close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
        hints = "".join(f" ({name}: did you mean {match[0]}?)" for name, match in close.items() if match)
        raise ValueError(
            f"{cls.__name__} has no field {', '.join(unknown)}{hints}. Its DAR fields are {', '.join(sorted(known))}; "
            "a config written by a newer dar-transformers may hold fields this version does not know: upgrade it."
        )


def dar_routing(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key streams kappa(j), value streams nu(j)) indexed by target stream j (DESIGN.md section 2, "routing")."""
    if config.dar_num_streams == 1:
        return (0,), (0,)
    pairs = ROUTING_KEY_VALUE_STREAMS[config.dar_routing]
    return tuple(key for key, _ in pairs), tuple(value for _, value in pairs)


@strict
class DARConfig(LlamaConfig):
    r"""
    Llama configuration plus the Dual Attention Residuals fields (see the module docstring).

    ```python
    >>> from dar_transformers import DARConfig, DARForCausalLM
    >>> config = DARConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    ...                    vocab_size=128, dar_block_size=2)
    >>> model = DARForCausalLM(config)
    ```"""

    model_type = "dar"
    # No pipeline-parallel plan (Llama's says a decoder layer maps hidden_states to hidden_states): a stage boundary
    # would have to carry the whole depth state, the committed history and the open block's partial, not one tensor
    # (README, "Serving"); without a plan `supports_pp_plan` is False.
    base_model_pp_plan = None
    # Auto class name -> "file.Class" of every class of this model type, as the folders the package writes name them
    # (the package's registration table, `dar_transformers.AUTO_CLASSES`, says the same: tests/test_remote_code.py).
    # A literal, not filled in at the package's import: remote code (a folder loaded without the package) saves
    # folders too, and a DAR-MoE it loaded from a dense DAR folder would keep the dense entries (`save_pretrained`).
    remote_code_auto_map: ClassVar[dict[str, str]] = {
        "AutoConfig": "configuration_dar.DARConfig",
        "AutoModel": "modeling_dar.DARModel",
        "AutoModelForCausalLM": "modeling_dar.DARForCausalLM",
        "AutoModelForSequenceClassification": "modeling_dar.DARForSequenceClassification",
        "AutoModelForQuestionAnswering": "modeling_dar.DARForQuestionAnswering",
        "AutoModelForTokenClassification": "modeling_dar.DARForTokenClassification",
    }

    dar_block_size: int | None = None
    dar_num_streams: int = 2
    dar_routing: str | None = None
    dar_write_mode: str = "duplicate"
    dar_gate_delta: float | None = None
    dar_rho_init: float = 0.95
    dar_include_partial: bool = True
    dar_count_scaling: bool = True
    dar_branch_family: str = "llama"
    dar_implementation: str = "fast"
    dar_history_dtype: str = "float32"
    dar_compiled_read: str = "inlined"
    dar_inference_kernel: str = "torch"
    dar_training_kernel: str = "torch"
    sliding_window: int | None = None

    # Fields besides the DAR ones that `__post_init__` derives defaults from: `from_dict` builds them in.
    derivation_fields: ClassVar[tuple[str, ...]] = ("num_hidden_layers",)
    # The fields of this class (not Llama's) that decide the function a saved model computes: one missing from a saved
    # config is warned about (`from_dict`). Not the backend options, nor the initialisation's spreads.
    function_fields: ClassVar[tuple[str, ...]] = (
        *(field for field in DAR_LAYOUT_FIELDS if field.startswith("dar_")), "sliding_window",
    )

    def __post_init__(self, **kwargs):
        refuse_unknown_dar_fields(type(self), kwargs)  # a key HF would set as an attribute and no module reads
        num_branches = 2 * self.num_hidden_layers
        if self.dar_block_size is None:
            self.dar_block_size = max(1, math.ceil(num_branches / DAR_TARGET_BLOCKS))
        if self.dar_routing is None:
            self.dar_routing = "dar" if self.dar_num_streams == 2 else "selfkv"
        if self.dar_gate_delta is None:
            self.dar_gate_delta = 0.0 if self.dar_routing == "fixedkv" else DAR_DEFAULT_DELTA
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """LlamaConfig's rule, the hidden size a multiple of the heads, for Llama branches only: Mistral's, Qwen2's
        and Qwen3's configs have no such rule (their attention is built from `head_dim`, as Qwen3 with 6 heads of 16
        at hidden size 64 is), and a DAR model of their branches computes theirs."""
        if self.dar_branch_family == "llama":
            super().validate_architecture()

    def validate_dar(self):
        """Part of `@strict` validation: every DAR field, with the field name and the allowed values."""
        check_layer_count(self, type(self).__name__)
        num_branches = 2 * self.num_hidden_layers
        if isinstance(self.dar_block_size, bool) or not 1 <= self.dar_block_size <= num_branches:
            raise ValueError(
                f"DARConfig.dar_block_size must be an integer in [1, {num_branches}] (branches: 2 per layer, "
                f"1 = Full DAR, {num_branches} = one block), got {self.dar_block_size!r}."
            )
        _must_be_one_of("dar_num_streams", self.dar_num_streams, (1, 2))
        if self.dar_num_streams == 1 and self.dar_routing != "selfkv":  # one stream has no other to address
            raise ValueError(f"DARConfig.dar_routing and dar_num_streams: with dar_num_streams=1 dar_routing must be "
                             f"one of ['selfkv'] (the one stream addresses its own history), got {self.dar_routing!r}.")
        _must_be_one_of("dar_routing", self.dar_routing, DAR_ROUTINGS)
        _must_be_one_of("dar_write_mode", self.dar_write_mode, DAR_WRITE_MODES)
        _must_be_one_of("dar_branch_family", self.dar_branch_family, DAR_BRANCH_FAMILIES)
        _must_be_one_of("dar_implementation", self.dar_implementation, DAR_IMPLEMENTATIONS)
        check_backend_options(self)
        if self.dar_history_dtype == "model" and self.dar_implementation == "fast":
            raise ValueError(
                "DARConfig.dar_history_dtype='model' needs dar_implementation 'two_phase' or 'reference' (the fused "
                "'fast' path keeps its depth buffers, and so the history, in float32), got dar_implementation='fast'."
            )
        check_sliding_window(self, "DARConfig")
        if not 0.0 < self.dar_rho_init < 1.0:
            raise ValueError(f"DARConfig.dar_rho_init must lie strictly between 0 and 1, got {self.dar_rho_init!r}.")
        if not (math.isfinite(self.dar_gate_delta) and self.dar_gate_delta >= 0.0):
            raise ValueError(f"DARConfig.dar_gate_delta must be a finite number >= 0, got {self.dar_gate_delta!r}.")
        if self.dar_routing == "fixedkv" and self.dar_gate_delta != 0.0:
            raise ValueError(
                "DARConfig.dar_gate_delta must be 0.0 with dar_routing='fixedkv': values come from stream 1 only, so "
                f"anti-symmetric write gates would change the function at initialisation (got {self.dar_gate_delta!r})."
            )

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """HF's `from_dict`, with the DAR fields and `derivation_fields` among the keyword overrides
        (`DARConfig.from_dict(llama_config.to_dict(), dar_num_streams=1)`) built into the config as `DARConfig(...)`
        takes them (a saved DAR folder's config.json holds the derived fields too, so an override there that
        contradicts one, `dar_num_streams=1` beside its stored routing 'dar', is refused naming it): HF builds
        the config from the file first and sets overrides on it after, when `__post_init__` has already derived the
        defaults that depend on them (routing from the stream count, the gate spread from the routing, the block size
        from the layers), so an override valid in `DARConfig(...)` failed, or got another default. Then the DAR
        validation again: HF checks the types of the other overrides only, so a bad value loaded (a block size beyond
        the layers re-initialised trained parameters as missing) or failed later without naming its field."""
        fields = cls.__dataclass_fields__
        refuse_unknown_dar_fields(cls, kwargs)  # HF would drop it as an unused keyword
        built = {key: kwargs.pop(key) for key in list(kwargs)
                 if key in fields and (key.startswith("dar_") or key in cls.derivation_fields)}
        config_dict = {**config_dict, **built}
        owned = [name for name in fields if name not in LlamaConfig.__dataclass_fields__]  # DAR's (and DAR-MoE's)
        for name in owned:  # a whole number where a float is typed (`0` for 0.0: JSON tools write it so)
            value = config_dict.get(name)
            if fields[name].type in (float, float | None) and type(value) is int:
                config_dict[name] = float(value)
        if config_dict.get("model_type") == cls.model_type:  # a saved config: every field is written
            missing = [name for name in cls.function_fields if name not in config_dict]
            if missing:
                defaults = ", ".join(f"{name}={fields[name].default!r}" for name in missing)
                logger.warning(
                    f"This {cls.model_type} config has no {', '.join(missing)}, which dar-transformers writes in "
                    f"every config; the defaults are taken ({defaults}; None: derived). A config.json edited by hand, "
                    "or written by an older version before the field existed?"
                )
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result).validate()
        return result

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs):
        """HF's `save_pretrained`, with every Auto class whose code is in the folder added to `auto_map`.

        A model's `save_pretrained` (and `dar convert`) first writes the model's flat code files and adds the one Auto
        class that model was registered for (`custom_object_save`); the base model and the other heads live in the same
        files, so they are added too: vLLM builds `AutoModel`, a fine-tuning user a task head. Entries are never
        removed: a config saved alone (its code file only) keeps the model classes of the folder it was loaded from,
        as transformers keeps them, since `config.push_to_hub` updates a repo whose model code is already there.
        """
        if getattr(self, "auto_map", None):  # not a declared field: transformers adds it when it writes code
            written = {path.stem for path in Path(save_directory).glob("*.py")}
            for auto_class, reference in self.remote_code_auto_map.items():
                if reference.split(".")[0] in written:  # replaced: an entry of another model type (a DAR-MoE loaded
                    self.auto_map[auto_class] = reference  # from a dense DAR folder) names classes of the wrong config
            # A dense DAR saved where a DAR-MoE was: transformers removes no file, and push_to_hub uploads them all.
            stale = sorted(f"{name}.py" for name in written & DAR_MOE_CODE_FILES if self.model_type == "dar")
            if stale:
                logger.warning(f"{save_directory} also holds {', '.join(stale)}, the code of a DAR-MoE model saved "
                               "there before, which this DAR model does not use: remove them before sharing the "
                               "folder (push_to_hub uploads every file in it).")
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @property
    def dar_num_branches(self) -> int:
        """M: attention and MLP branches of all decoder layers."""
        return 2 * self.num_hidden_layers

    @property
    def dar_write_scale(self) -> float:
        """c in beta = c * sigmoid(b): J for duplicate writes, 1 for split writes (sum of the gates stays c)."""
        return float(self.dar_num_streams) if self.dar_write_mode == "duplicate" else 1.0

    @property
    def dar_read_scale(self) -> float:
        """eta in u = eta * (alpha x^0 + (1 - alpha) x^1): 1 for duplicate writes, J for split writes."""
        return 1.0 if self.dar_write_mode == "duplicate" else float(self.dar_num_streams)

    @property
    def dar_embedding_scale(self) -> float:
        """Each stream's history entry 0 is embedding * this (1 duplicate, 1/J split)."""
        return 1.0 if self.dar_write_mode == "duplicate" else 1.0 / self.dar_num_streams


__all__ = ["DARConfig"]
