"""The tiny random-weight Qwen3-Next the vLLM tier runs, built at first use.

    python -m hybridpd.engine.vllm.tiny [--out DIR]

The config is ``assets/tiny-qwen3next.json`` (shared/fixtures' tiny Qwen3-Next
with our 2,048-token BPE vocabulary); weights come from transformers'
``from_config`` under a fixed seed and are saved with ``save_pretrained``;
the tokenizer is the bundled one (``hybridpd/model_files.py``), so the router tokenizes exactly as
vLLM does. Needs transformers (the vLLM environment has it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from hybridpd.model_files import TOKENIZER_DIR, TOKENIZER_FILES, build_atomically, home

CONFIG = Path(__file__).parent / "assets" / "tiny-qwen3next.json"
SEED = 1234
NAME = "tiny-qwen3next"


def _digest() -> str:
    h = hashlib.sha256(CONFIG.read_bytes() + str(SEED).encode())
    for name in TOKENIZER_FILES:
        h.update((TOKENIZER_DIR / name).read_bytes())
    return h.hexdigest()[:12]


def build(out: Path) -> Path:
    """Write config, seeded random weights and the tokenizer into ``out`` (atomically)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def write(tmp: Path) -> None:
        torch.manual_seed(SEED)
        config = AutoConfig.for_model(**json.loads(CONFIG.read_text()))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp / "tokenizer.json")
        tok_cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # so HF/vLLM load the same tokenizer
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))

    return build_atomically(out, write)


def resolve() -> Path:
    """The built model directory (built now if missing)."""
    out = home() / "models" / ("%s-%s" % (NAME, _digest()))
    if not (out / "config.json").exists():
        build(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(build(args.out) if args.out else resolve())


if __name__ == "__main__":
    main()
