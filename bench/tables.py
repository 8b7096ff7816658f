"""bench/README.md's tables, and every generated number of the docs, from the committed JSON.

    python -m bench.tables            # rewrite the generated blocks and numbers
    python -m bench.tables --check    # exit 1, with a diff, where one differs

Two kinds of generated text:

* a **block** between ``<!-- generated: NAME -->`` and ``<!-- /generated: NAME -->``
  in bench/README.md, a pure function of one results file (``BLOCKS``): per machine
  kind a provenance line (dates, commits, load, the machine, versions, repeats,
  whether the variants are one run) and the table of medians (min-max of the
  repeats where they differ); then the file's ``checks``;
* a **number** between ``<!-- json:PATH#KEY SPEC -->`` and ``<!-- /json -->`` in
  bench/README.md, docs/DESIGN.md or README.md (``DOCS``): the value at ``KEY``
  (dot-separated; an integer indexes a list) of the JSON file ``PATH`` (from the
  repository root), formatted with the format spec ``SPEC`` (``.3f``, ``,.0f``,
  ``.0%``; optional; a leading ``/1024`` divides first).

Everything else is prose: it interprets, and a number it states by itself is
marked "by hand" (``tests/unit/test_prose_numbers.py``).

Comparisons are judged only within one run. A check that compares variants
(``COMPARISONS``) reads "not comparable" unless the file's variants are one run
(one clean commit, one machine, one sitting: ``bench.provenance.same_run``); a ratio
against a baseline is printed only where the two are one run. A table never mixes
machines: variants measured on different machine kinds get one table each. A
result recorded from a dirty tree is refused. ``tests/unit/test_bench_tables.py``
regenerates every block and fails on any difference.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import machines, provenance
from bench.block_renderers import (
    RESULTS,
    dropping,
    first_table,
    module_markdown,
    placement,
    promises,
    shared_prefix,
    soak,
    variants_table,
    vllm_client,
)
from bench.doc_numbers import ROOT, render_numbers
from bench.provenance_text import checks_lines, difference, provenance_line

README = Path(__file__).resolve().parent / "README.md"
#: the documents whose generated numbers ``main`` rewrites and checks
DOCS = (README, ROOT / "docs" / "DESIGN.md", ROOT / "README.md")

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)", re.S)
#: block name -> (results file, table renderer); ``machines`` lists every file with its machine
BLOCKS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "growing-streams-quick": ("growing_streams_quick.json", variants_table("bench.growing_streams")),
    "shared-prefix-quick": ("shared_prefix_quick.json", shared_prefix),
    "shared-prefix-placement-quick": ("shared_prefix_placement_quick.json", shared_prefix),
    "placement": ("placement.json", placement),
    "multi-turn-quick": ("multi_turn_quick.json", first_table("bench.multi_turn_run")),
    "overhead": ("overhead.json", module_markdown("bench.overhead")),
    "vllm-client-pd-quick": ("vllm_client_pd_quick.json", vllm_client),
    "router": ("router.json", dropping("bench.router", "CPU time")),
    "index-scale": ("index_scale_quick.json", dropping("bench.index_scale", "Encodings", "Ingestion")),
    "hashing": ("hashing.json", module_markdown("bench.hashing")),
    "engine": ("engine.json", dropping("bench.engine", "| k ")),
    "state-plane": ("state_plane.json", module_markdown("bench.state_plane")),
    "soak": ("soak.json", soak),
    "vllm-index-promises": ("vllm_index_promises.json", promises),
    "machines": ("", lambda out: ""),
}


#: blocks whose module's ``markdown`` renders its checks itself (as a budget table)
RENDER_OWN_CHECKS = frozenset({"router", "overhead", "index-scale"})


def _by_kind(out: dict[str, Any]) -> dict[str, list[str]]:
    """The variants of ``out`` by machine kind, in order (a variant measured on several
    kinds is a kind of its own; one without provenance takes the file's machine)."""
    fallback = provenance.machine_kind(out.get("machine") if isinstance(out.get("machine"), dict) else None)
    kinds: dict[str, list[str]] = {}
    for name, v in out["variants"].items():
        seen = sorted({provenance.machine_kind(r.get("machine")) for r in provenance.records_of(v)})
        kinds.setdefault(" + ".join(seen) if seen else fallback, []).append(name)
    return kinds


def render_block(name: str, results: Path = RESULTS) -> str:
    """The generated text of block ``name`` from its results file."""
    if name not in BLOCKS:
        raise KeyError("unknown generated block %r (known: %s)" % (name, ", ".join(BLOCKS)))
    filename, table = BLOCKS[name]
    if name == "machines":
        return machines.markdown(results)
    path = results / filename
    if not path.exists():
        return "_No results file `bench/results/%s` yet._\n" % filename
    out = json.loads(path.read_text())
    kinds = _by_kind(out) if isinstance(out.get("variants"), dict) else {"": []}
    parts = []
    for i, names in enumerate(kinds.values()):
        sub = out if len(kinds) == 1 else {**out, "variants": {n: out["variants"][n] for n in names}}
        parts.append(("\n" if i else "") + "%s\n%s" % (provenance_line(filename, sub, out), table(sub)))
    checks = "" if name in RENDER_OWN_CHECKS else checks_lines(out, difference(name, out))
    return "".join(parts) + checks


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every generated block replaced by its current rendering."""

    def sub(m: re.Match[str]) -> str:
        return m.group(1) + render_block(m.group("name"), results) + m.group(4)

    return _BLOCK.sub(sub, text)


def regenerate(path: Path, text: str, results: Path = RESULTS, root: Path = ROOT) -> str:
    """``text`` of the document ``path`` with its blocks (bench/README.md) and numbers regenerated."""
    return render_numbers(render(text, results) if path == README else text, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff where a block or number differs")
    ap.add_argument("--readme", type=Path, default=None, help="only this document (its blocks and numbers)")
    args = ap.parse_args(argv)
    status = 0
    for doc in [args.readme] if args.readme else list(DOCS):
        old = doc.read_text()
        new = render_numbers(render(old)) if args.readme else regenerate(doc, old)
        if new == old:
            continue
        if args.check:
            sys.stdout.writelines(
                difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(doc), "generated")
            )
            status = 1
        else:
            doc.write_text(new)
            print("rewrote %s" % doc)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
