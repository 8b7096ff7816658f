"""The plot and README tables of ``bench index-scale`` (from its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import spread
from bench.router import checks_markdown, fmt_range, repeats_phrase


def plot(path: Path, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = out["levels"]
    xs = [v["memberships"] for v in lv.values()]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for n in out["sizes"]:
        key = "tokens_%d" % n
        axes[0].plot(xs, [v[key]["p99_ms"] for v in lv.values()], marker="o", label="%dK p99" % (n // 1000))
        axes[0].plot(xs, [v[key]["p50_ms"] for v in lv.values()], marker=".", ls="--", label="%dK p50" % (n // 1000))
    axes[0].set_xscale("log")
    axes[0].set_xlabel("memberships")
    axes[0].set_ylabel("decision ms")
    axes[0].set_title("decision latency vs index size", fontsize=10)
    axes[0].legend(fontsize=7)
    axes[1].plot(xs, [v["bytes_per_membership"] for v in lv.values()], marker="o", label="per membership")
    axes[1].plot(xs, [v["bytes_per_store_entry"] for v in lv.values()], marker="o", label="per store entry")
    axes[1].set_xscale("log")
    axes[1].set_ylabel("Redis bytes")
    axes[1].set_title("memory", fontsize=10)
    axes[1].legend(fontsize=7)
    lad = out["ingestion"]["ladder"]
    axes[2].plot([r["achieved_events_s"] for r in lad], [r["p99_ms"] for r in lad], marker="o", label="p99")
    axes[2].axhline(out["ingestion"]["budget_ms"], color="red", ls=":", label="budget")
    axes[2].set_xlabel("events/s ingested")
    axes[2].set_ylabel("164K decision ms")
    axes[2].set_title("decision under ingestion (top level)", fontsize=10)
    axes[2].legend(fontsize=7)
    fig.suptitle(
        "index at scale, %d instances, unit %d, median of %d repeats"
        % (out["instances"], out["unit"], out["repeat_count"]),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(out: dict[str, Any]) -> str:
    """The README tables of a ``run`` result."""
    sizes = out["sizes"]
    rows = [
        "%s; %d live prefill instances; unit %d; %d decisions per size and level (hash chain + one"
        " `lookup.lua` + choice). Content by membership share: %s."
        % (
            repeats_phrase(out["repeat_count"]),
            out["instances"],
            out["unit"],
            out["iterations"],
            ", ".join("%s %.0f%%" % (k, 100 * v) for k, v in out["content"].items()),
        ),
        "",
        "| memberships | store entries | Redis MiB | B / membership | B / store entry | "
        + " | ".join("%dK p50 / p99 ms" % (n // 1000) for n in sizes)
        + " | Redis CPU / 164K lookup ms |",
        "|---|---|---|---|---|" + "---|" * len(sizes) + "---|",
    ]
    for key, v in out["levels"].items():
        cells = [
            "{:,}".format(v["memberships"]),
            "{:,}".format(v["store_entries"]),
            spread(out, "levels", key, "used_memory_mb", spec="%.0f"),
            spread(out, "levels", key, "bytes_per_membership", spec="%.0f"),
            spread(out, "levels", key, "bytes_per_store_entry", spec="%.0f"),
        ]
        for n in sizes:
            t = "tokens_%d" % n
            cells.append(
                "%s / %s"
                % (
                    spread(out, "levels", key, t, "p50_ms", spec="%.2f"),
                    spread(out, "levels", key, t, "p99_ms", spec="%.2f"),
                )
            )
        cells.append(spread(out, "levels", key, "tokens_%d" % sizes[-1], "redis_cpu_ms_per_lookup", spec="%.2f"))
        rows.append("| " + " | ".join(cells) + " |")
    ing = out["ingestion"]
    rows += [
        "",
        "Ingestion at the top level (an event: one block stored or removed on one instance, through"
        " `PrefixIndex.apply_local`); budget: the 164K decision p99 <= %.1fx its idle value (%s ms)."
        % (
            out["budget_factor"],
            fmt_range(ing["budget_ms"], out["min"]["ingestion"]["budget_ms"], out["max"]["ingestion"]["budget_ms"]),
        ),
        "",
        "| target events/s | achieved events/s | 164K decision p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for i, r in enumerate(ing["ladder"]):
        rows.append(
            "| {:,} | {} | {} | {} |".format(
                r["target_events_s"],
                spread(out, "ingestion", "ladder", i, "achieved_events_s", spec="%.0f"),
                spread(out, "ingestion", "ladder", i, "p50_ms", spec="%.2f"),
                spread(out, "ingestion", "ladder", i, "p99_ms", spec="%.2f"),
            )
        )
    rows += [
        "",
        "Sustained within budget: %s events/s. Ingester alone: %s events/s, Redis CPU %s us per event."
        % (
            spread(out, "ingestion", "sustained_events_s", spec="%.0f"),
            spread(out, "ingestion", "alone_events_s", spec="%.0f"),
            spread(out, "ingestion", "redis_cpu_us_per_event", spec="%.2f"),
        ),
        "",
        "Encodings, the same content at {:,} memberships:".format(out["encoding_level"]),
        "",
        "| encoding | Redis keys | B / membership |",
        "|---|---|---|",
    ]
    for name, e in out["encodings"].items():
        rows.append(
            "| %s | {:,} | %s |".format(e["keys"])
            % (name, spread(out, "encodings", name, "bytes_per_membership", spec="%.1f"))
        )
    names = {"growth_p99_%d" % sizes[-1]: "164K decision p99, top level / lowest level"}
    rows += ["", *checks_markdown(out["checks"], names, spec="%.2f")]
    return "\n".join(rows) + "\n"
