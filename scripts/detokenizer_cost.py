"""What detokenizing costs the engine per token with a real (Hugging Face fast) tokenizer,
which the benchmarks' random presets, with their byte tokenizer, never pay: roseray's
window detokenizer (two `tokenizer.decode` calls per token, what any tokenizer without a
piece table gets), its table detokenizer (what a byte-level BPE tokenizer gets through
roseray's HFTokenizer: tokenizer.byte_level_pieces) and the tokenizers library's own
incremental decoder (`tokenizers.decoders.DecodeStream`, Rust), on a byte-level BPE
tokenizer trained here (no download). All three must give the same text. CPU only.

    python scripts/detokenizer_cost.py [--requests 128] [--steps 100] [--vocab 2000]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from roseray.engine.detokenizer import IncrementalDetokenizer, make_detokenizer
from roseray.tokenizer import HFTokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "serving", "engine", "token",
         "stream", "batch", "kernel", "cache", "paged", "héllo", "日本語", "naïve"]


def byte_level_bpe(vocab_size: int, rng: random.Random) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(rng.choice(WORDS) for _ in range(50)) for _ in range(2000)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128, help="requests detokenized per step")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    backend = byte_level_bpe(args.vocab, rng)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(4 * args.steps)))[: args.steps + 5]
    prompt, output = ids[:5], ids[5:]

    def run(detokenizers: list) -> float:
        started = time.perf_counter()
        for token_id in output:
            for detokenizer in detokenizers:
                detokenizer.step_token(token_id)
        for detokenizer in detokenizers:
            detokenizer.flush()
        return time.perf_counter() - started

    window = [IncrementalDetokenizer(tokenizer, prompt) for _ in range(args.requests)]
    window_s = run(window)
    wrapped = HFTokenizer(tokenizer, "trained")
    wrapped.piece_table(True)  # built once, when the engine starts
    table = [make_detokenizer(wrapped, prompt) for _ in range(args.requests)]
    table_s = run(table)

    streams = [DecodeStream(ids=list(prompt), skip_special_tokens=True) for _ in range(args.requests)]
    texts = ["" for _ in streams]
    started = time.perf_counter()
    for token_id in output:
        for index, stream in enumerate(streams):
            texts[index] += stream.step(backend, token_id) or ""
    stream_s = time.perf_counter() - started

    tokens = len(output) * args.requests
    expected = tokenizer.decode(output)
    for name, seconds, text in ((type(window[0]).__name__, window_s, window[0].output_text),
                                (type(table[0]).__name__, table_s, table[0].output_text),
                                ("DecodeStream", stream_s, texts[0])):
        print(f"{name}: {seconds / tokens * 1e6:.2f} us per token, {seconds / len(output) * 1e3:.3f} ms per step "
              f"of {args.requests} requests; the text of decode(all tokens): {text == expected}")


if __name__ == "__main__":
    main()
