"""Train the tiny model's byte-level BPE tokenizer on local text.

    .venv/bin/python scripts/train_tokenizer.py [--vocab 2048]

Corpus: the docstrings and comments of this Python's standard library (on
every machine, no download). Writes ``tokenizer.json`` and
``tokenizer_config.json`` (chat template, special tokens) into
``hybridpd/assets/``; both are committed.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "hybridpd" / "assets"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(corpus(), trainer)
    ASSETS.mkdir(parents=True, exist_ok=True)
    tok.save(str(ASSETS / "tokenizer.json"))
    config = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
        "stop_tokens": ["<eos>", "<|im_end|>"],
    }
    (ASSETS / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print("vocab %d -> %s" % (tok.get_vocab_size(), ASSETS))


if __name__ == "__main__":
    main()
