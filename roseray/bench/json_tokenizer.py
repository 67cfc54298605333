"""A byte-level BPE tokenizer for benchmarks on random weights that must write JSON.

    python -m roseray.bench json-tokenizer /tmp/m/qwen3-0.6b

The peer kit's model directories carry a word-level tokenizer (t0..tN) that cannot spell `{`;
W-json needs one with a real vocabulary. This trains a byte-level BPE (the GPT-2/Qwen kind) on
Python sources (the standard library's, or `--corpus`), to about the model's vocabulary size, with `<|endoftext|>`
(id 0) as EOS and a ChatML chat template, writes it into the directory, and makes
`<|endoftext|>` the model's EOS in config.json (and generation_config.json) so that every
engine ends where the grammar does. The vocabulary depends on the Python version's sources.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus_files(root: Path, max_bytes: int) -> list[str]:
    """The UTF-8 .py files under `root`, in path order, up to `max_bytes` (a stdlib holds a few test
    files in other encodings, which the trainer refuses)."""
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(str(path))
        total += size
    return files


def write_tokenizer(model_dir: Path, vocab_size: int, max_bytes: int, corpus: Path | None = None) -> int:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tokenizer.train(corpus_files(corpus or Path(sysconfig.get_paths()["stdlib"]), max_bytes), trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "special_tokens_map.json").unlink(missing_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL_TOKENS[0],
              "pad_token": SPECIAL_TOKENS[0], "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            values = json.loads(path.read_text())
            values["eos_token_id"] = values["bos_token_id"] = 0
            path.write_text(json.dumps(values, indent=1))
    return tokenizer.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench json-tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="a Hugging Face model directory (config.json)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the model's vocab_size")
    parser.add_argument("--corpus", type=Path, default=None, help="a directory of .py files (default: the stdlib)")
    parser.add_argument("--max-corpus-mb", type=float, default=60.0, help="training text read at most")
    args = parser.parse_args(argv)
    vocab_size = args.vocab_size or json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    size = write_tokenizer(args.model_dir, vocab_size, int(args.max_corpus_mb * 2**20), args.corpus)
    print(f"wrote a byte-level BPE tokenizer of {size} tokens to {args.model_dir}")
    return 0
