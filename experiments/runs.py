# SPDX-License-Identifier: Apache-2.0
"""What makes two replication runs the same experiment: one key for `replicate.py` (which runs are done, where a
checkpoint goes) and `summarize.py` (which runs are compared with each other). Runs that differ in any setting of
`CONFIGURATION` are different experiments: comparing them seed by seed, or skipping one because the other is done,
reports one setting's loss as another's."""

import hashlib
import re
from collections.abc import Mapping

# The run settings that change what a variant's validation loss means: the token budget as asked for, batch shape,
# learning rate, weight decay, vocabulary (the BPE is trained per size) and the corpus (a hash of its two splits).
CONFIGURATION = ("train_tokens", "batch_size", "seq_len", "lr", "weight_decay", "vocab_size", "corpus")


def configuration_key(settings: Mapping[str, object]) -> str:
    """"tok600000/bs8x256/lr0.002/wd0.1/vocab4096/corpus1a2b3c4d" of `CONFIGURATION`'s settings."""
    return (f"tok{settings['train_tokens']}/bs{settings['batch_size']}x{settings['seq_len']}/lr{settings['lr']}"
            f"/wd{settings['weight_decay']}/vocab{settings['vocab_size']}/corpus{settings['corpus']}")


def configuration_hash(settings: Mapping[str, object]) -> str:
    """Eight hex digits of `configuration_key`, for names that must stay short (checkpoint folders)."""
    return hashlib.sha256(configuration_key(settings).encode()).hexdigest()[:8]


def record_configuration(record: Mapping[str, object]) -> dict[str, object]:
    """The `CONFIGURATION` settings of a results record. Records written before the corpus and the asked-for budget
    were fields of their own carry them in their key ("variant/seed0/tok600000/.../corpusXXXX"), which is read."""
    settings = {name: record.get(name) for name in CONFIGURATION}
    key = str(record.get("key", ""))
    asked = re.search(r"/tok(\d+)/", key)
    if "requested_train_tokens" in record:
        settings["train_tokens"] = record["requested_train_tokens"]
    elif asked:
        settings["train_tokens"] = int(asked.group(1))
    if settings["corpus"] is None:
        corpus = re.search(r"/corpus([^/]+)$", key)
        settings["corpus"] = corpus.group(1) if corpus else "unknown"
    return settings


def record_key(record: Mapping[str, object]) -> str:
    """The run key of a results record: variant, seed and its configuration."""
    return f"{record['variant']}/seed{record['seed']}/{configuration_key(record_configuration(record))}"
