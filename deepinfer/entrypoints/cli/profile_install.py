"""`deepinfer profile install PROFILE.json`: put a freshly measured profile among the
shipped ones (sim/data/profiles/), and say how it moved.

Prints, by step kind, the median ratio of the new profile's step times to the shipped
one's over the points both measured (same kind, same groups), and the points that moved
most, then copies the file over the shipped one of the same name. A profile measured in
a copied working tree (the device machine's) records a commit its git could not know:
`--commit` sets the one measured, and clears `commit_dirty`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def add_install_parser(sub: Any) -> None:
    p = sub.add_parser(
        "install",
        prog="deepinfer profile install",
        help="compare a re-measured profile with the shipped one, then replace it",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("profile", type=Path, help="the measured profile (its file name is kept)")
    p.add_argument("--commit", default=None, help="the commit the profile was measured at")
    p.add_argument("--dry-run", action="store_true", help="compare only; install nothing")
    p.set_defaults(func=run_install)


def _key(point: dict[str, Any]) -> str:
    return json.dumps([point["kind"], point["groups"]])


def compare(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """By kind: points both profiles measured, the median new/old ratio of median_s (and
    of pipelined_s where both have it), and the largest moves as (ratio, key)."""
    import statistics  # (here: every command line would pay for it otherwise)

    old_points = {_key(p): p for p in old["points"]}
    by_kind: dict[str, dict[str, list]] = {}
    for p in new["points"]:
        q = old_points.get(_key(p))
        if q is None:
            continue
        if not (q["median_s"] > 0 and p["median_s"] > 0):
            continue
        row = by_kind.setdefault(p["kind"], {"median": [], "pipelined": [], "moves": []})
        r = p["median_s"] / q["median_s"]
        row["median"].append(r)
        row["moves"].append((r, _key(p), q["median_s"], p["median_s"]))
        if p.get("pipelined_s") and q.get("pipelined_s"):
            row["pipelined"].append(p["pipelined_s"] / q["pipelined_s"])
    out = {}
    for kind, row in sorted(by_kind.items()):
        moves = sorted(row["moves"], key=lambda m: abs(math.log(m[0])), reverse=True)
        out[kind] = {
            "points": len(row["median"]),
            "median_ratio": statistics.median(row["median"]),
            "pipelined_ratio": statistics.median(row["pipelined"]) if row["pipelined"] else None,
            "largest_moves": moves[:3],
        }
    return out


def run_install(args: argparse.Namespace) -> int:
    from sim.profiled_cost_model import PROFILES_DIR

    new = json.loads(args.profile.read_text())
    target = PROFILES_DIR / args.profile.name
    if target.exists():
        old = json.loads(target.read_text())
        print(f"{args.profile.name}: new / shipped, median over the points both measured")
        for kind, row in compare(new, old).items():
            pipe = row["pipelined_ratio"]
            print(
                f"  {kind:8s} {row['points']:4d} points  median_s {row['median_ratio']:.3f}"
                + (f"  pipelined_s {pipe:.3f}" if pipe else "")
            )
            for r, key, before, after in row["largest_moves"]:
                print(f"      {r:.3f}  {key}: {1e3 * before:.2f} -> {1e3 * after:.2f} ms")
    else:
        print(f"{args.profile.name}: no shipped profile of that name; nothing to compare")
    if args.commit:
        new["meta"]["commit"] = args.commit
        new["meta"]["commit_dirty"] = False
    elif new["meta"].get("commit_dirty"):
        print(
            f"warning: {args.profile.name} was measured in a tree that differs from commit "
            f"{new['meta'].get('commit')}: give --commit (the one measured)",
            file=sys.stderr,
        )
    if args.dry_run:
        return 0
    target.write_text(json.dumps(new, indent=1) + "\n")
    print(f"installed {target}", file=sys.stderr)
    return 0
