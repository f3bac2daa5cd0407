"""Weak scaling, before and after: the TPU-era pmap step and the migrated jit step in worker
processes on the CPU backend at 1, 2, 4 and 8 devices, the same per-device batch, steps and warm-up
(the core is `migration.service.scaling_runs.scaling_table`; this script parses flags and prints).

    python bench/scaling.py [--workload transformer] [--preset tiny] [--devices 1,2,4,8]
                            [--batch 8] [--steps 20] [--warmup 3] [--csv PATH]

Every figure is a CPU-backend timing (XLA's CPU devices share the host's cores): it compares the two
step styles on this machine; it is not a GPU figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import record  # noqa: E402
from migration.common import ConfigError, write_csv  # noqa: E402
from migration.grading.scaling import loss_tolerance  # noqa: E402
from migration.service.scaling_runs import scaling_table  # noqa: E402

COLUMNS = (("devices", "devices", "{}"), ("style", "style", "{}"), ("global batch", "global_batch", "{}"),
           ("samples/s", "samples_per_s", "{:,.1f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
           ("step ms (median)", "step_ms_median", "{:.2f}"), ("scaling eff.", "scaling_efficiency", "{:.0%}"),
           ("jit/pmap", "jit_over_pmap", "{:.2f}x"), ("losses match", "losses_match", "{}"),
           ("max loss rel. diff", "max_loss_rel_diff", "{:.1e}"))


def device_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated device counts like 1,2,4,8; got {text!r}") from None
    if not counts or any(n < 1 for n in counts) or 1 not in counts:
        raise argparse.ArgumentTypeError(f"positive device counts including 1 (the efficiency baseline); got {text!r}")
    return counts


def cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row[key]
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return fmt.format(value)


def table(rows: list[dict[str, Any]]) -> str:
    header = [title for title, _, _ in COLUMNS]
    body = [[cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt_line = lambda line: "  ".join(v.rjust(w) for v, w in zip(line, widths))  # noqa: E731
    return "\n".join([fmt_line(header), fmt_line(["-" * w for w in widths]), *map(fmt_line, body)])


def label(rows: list[dict[str, Any]]) -> str:
    ok = next((r for r in rows if r["status"] == "ok"), rows[0])
    backend = (ok["backend"] or "unknown").upper()
    return (f"{backend}-backend timings on device kind '{ok['device_kind']}', JAX {ok['jax_version']}, "
            f"measured {ok['measured_on']}: {ok['workload']} {ok['preset']}, {ok['per_device_batch']} "
            f"examples per device (weak scaling), {ok['steps']} steps of which {ok['warmup_steps']} warm-up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--devices", type=device_counts, default=(1, 2, 4, 8), help="default 1,2,4,8")
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (default 8)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps, not timed (default 3)")
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    parser.add_argument("--json", metavar="PATH", help="write the table as a record (bench/results/scaling.json)")
    args = parser.parse_args()

    progress = lambda ev: print(ev["message"], file=sys.stderr, flush=True)  # noqa: E731
    try:
        rows = scaling_table(args.workload, args.preset, args.devices, per_device_batch=args.batch,
                             steps=args.steps, warmup_steps=args.warmup, platform="cpu", on_progress=progress)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(label(rows))
    print(table(rows))
    print(f"Scaling efficiency: samples/s at n / (n x samples/s at 1 device), same style. jit/pmap: the jit "
          f"step's samples/s over the pmap step's at the same n. Losses match: every step's loss within "
          f"{loss_tolerance('fp32'):g} relative (fp32). XLA's CPU devices share this host's cores, so efficiency here falls with n "
          f"by construction; the figures compare the two step styles, they do not predict GPU scaling.")
    record.write(args.json, "scaling", [record.table(
        label(rows), [title for title, _, _ in COLUMNS], [[cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows])])
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        print(f"{r['style']} on {r['devices']} device(s) {r['status']}: {r['message']}")
    if args.csv:
        write_csv(rows, path=args.csv)
        print(f"CSV: {args.csv}")
    return 1 if failed or any(r["losses_match"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
