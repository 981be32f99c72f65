"""Where the admission benchmark's revocation risk is priced too high, and why (issue 19).

Reads the admission benchmark's results (``admission.json``, ``admission-1024.json``; no
simulation is re-run) and the shipped spot traces. Per scenario and trace, over every policy's
windows:

* lost tries expected (Σ p over the priced tries) against those seen, from each window's
  ``model`` record;
* the trace's young-pool hazard: of the ticks that held revocable instances at an age under
  ``YOUNG`` ticks since the pool last changed, the share after which the pool lost instances —
  over the whole trace (what the risk's age factors are estimated from, ``GpuSupply.age_factors``)
  and over the benchmark's windows (as far as the slowest policy's run reached in each).

* the trace's revocation events at any age: the share of ticks holding revocable instances
  after which the pool lost some, and the mean share of the revocable instances each such event
  took (``GpuSupply.revocation_events``' fractions), over the whole trace and over the windows;
* per policy, lost tries expected and seen, and how far apart in Poisson deviations
  (z = (seen − expected) / √expected). The policies replay the same windows, so they meet the
  same revocation events and their counts are not independent: the aggregate's z lies between
  ``z_independent`` (the policies' counts independent: the sum's Poisson z) and ``z_shared``
  (one count seen by every policy: the aggregate's relative deviation over one policy's
  1/√(expected / policies), which is ``z_independent`` / √policies).

When the windows' young-pool share is below the trace's, the risk priced from the trace's
history is higher than what the windows deliver: the windows fall in calmer stretches of the
trace. A model could not correct that without looking ahead (the history includes the windows).
Writes ``benchmarks/results/risk-windows.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from admission import SCENARIOS
from common import RESULTS, write

from nereus.sim.trace import AGE_BINS, GpuSupply, SpotTrace
from nereus.spec.registry import trace_path

YOUNG = 8  # ticks: the age bins that start below this are the young pool's
INPUTS = "admission.json,admission-1024.json"


def supply(name: str, trace: str, offset: int) -> GpuSupply:
    """The scenario's GPU supply on ``trace`` from ``offset``, as ``admission.scenario`` builds it."""
    _, per_instance, lo, hi, speedup, _, _ = SCENARIOS[name]
    return GpuSupply(SpotTrace.load(trace_path(trace)), per_instance, hi, lo, offset, speedup, offset)


def young_share(s: GpuSupply, first: int = 0, end: int | None = None) -> tuple[int, int]:
    """(ticks at a young age after which the pool lost instances, ticks at a young age held)."""
    exposed, drops = s.age_counts(first, end)
    young = [k for k, lo in enumerate(AGE_BINS) if lo < YOUNG]
    return sum(drops[k] for k in young), sum(exposed[k] for k in young)


def events(s: GpuSupply, first: int = 0, end: int | None = None) -> tuple[int, int, float]:
    """(ticks after which the pool lost revocable instances, ticks holding some, the mean share
    of the revocable instances those events took) over ticks ``[first, end)``, at any age."""
    exposed, drops = s.age_counts(first, end)
    shares = s.revocation_events(first, end)[1]
    return sum(drops), sum(exposed), sum(shares) / len(shares) if shares else 0.0


def deviations(policies: dict[str, Any], trace: str) -> dict[str, Any]:
    """Per policy, lost tries expected and seen on ``trace`` with their Poisson z; the
    aggregate's z if the policies' counts were independent and if they were one count shared."""
    per: dict[str, dict[str, float]] = {}
    for name, p in policies.items():
        ws = [w for w in p["windows"] if w["trace"] == trace]
        expected = sum(w["model"]["lost_tries_predicted"] for w in ws)
        seen = sum(w["model"]["lost_tries"] for w in ws)
        z = (seen - expected) / math.sqrt(expected) if expected > 0 else 0.0
        per[name] = {"expected": expected, "seen": seen, "z": z}
    expected = sum(e["expected"] for e in per.values())
    seen = sum(e["seen"] for e in per.values())
    independent = (seen - expected) / math.sqrt(expected) if expected > 0 else 0.0
    shared = (seen / expected - 1.0) * math.sqrt(expected / len(per)) if expected > 0 else 0.0
    return {"per_policy": per, "z_independent": independent, "z_shared": shared}


def by_trace(name: str, policies: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per trace: lost tries expected and seen over all policies and windows, and the young-pool
    share of the whole trace and of the windows."""
    extents: dict[tuple[str, int], float] = {}
    out: dict[str, dict[str, Any]] = {}
    for p in policies.values():
        for w in p["windows"]:
            e = out.setdefault(w["trace"], {"expected": 0.0, "seen": 0, "priced": 0})
            e["expected"] += w["model"]["lost_tries_predicted"]
            e["seen"] += w["model"]["lost_tries"]
            e["priced"] += w["model"]["priced_tries"]
            key = (w["trace"], w["offset"])
            extents[key] = max(extents.get(key, 0.0), w["total_s"])
    for trace, e in out.items():
        whole = young_share(supply(name, trace, 0))
        lost, held = 0, 0
        for (t, offset), total_s in sorted(extents.items()):
            if t == trace:
                s = supply(name, trace, offset)
                d, n = young_share(s, offset, s.tick(total_s) + 1)
                lost, held = lost + d, held + n
        e["young_lost_ticks_trace"], e["young_held_ticks_trace"] = whole
        e["young_lost_ticks_windows"], e["young_held_ticks_windows"] = lost, held
        drops, ticks, size = events(supply(name, trace, 0))
        e["drop_ticks_trace"], e["held_ticks_trace"], e["event_share_trace"] = drops, ticks, size
        w_drops, w_ticks, w_shares = 0, 0, 0.0
        for (t, offset), total_s in sorted(extents.items()):
            if t == trace:
                s = supply(name, trace, offset)
                d, n, share = events(s, offset, s.tick(total_s) + 1)
                w_drops, w_ticks, w_shares = w_drops + d, w_ticks + n, w_shares + share * d
        e["drop_ticks_windows"], e["held_ticks_windows"] = w_drops, w_ticks
        e["event_share_windows"] = w_shares / w_drops if w_drops else 0.0
        e.update(deviations(policies, trace))
        e["risk_ratio"] = e["expected"] / e["seen"] if e["seen"] else None
        share_trace = whole[0] / whole[1] if whole[1] else 0.0
        share_windows = lost / held if held else 0.0
        e["young_share_ratio"] = share_trace / share_windows if share_windows else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the admission JSONs are")
    ap.add_argument("--inputs", default=INPUTS, help="the admission JSONs to read, comma-separated")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    inputs = [f for f in args.inputs.split(",") if f]
    table: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for file in inputs:
        path = args.results / file
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        windows = [w for e in doc["results"].values() for p in e["policies"].values() for w in p["windows"]]
        if any("lost_tries_predicted" not in w["model"] for w in windows):
            ap.error(f"--results: {path} predates the try-by-try risk records (0e1c78b); re-run admission.py")
        sources[file] = doc["git_sha"]
        for name, entry in doc["results"].items():
            table[name] = by_trace(name, entry["policies"])
    if not table:
        ap.error(f"--results: none of {', '.join(inputs)} under {args.results}")
    print(f"{'scenario':18s} {'trace':12s} {'lost tries exp → seen':>22s} {'×':>5s}   young-pool loss share")
    for name, traces in table.items():
        for trace, e in traces.items():
            ratio = f"{e['risk_ratio']:.2f}" if e["risk_ratio"] else "-"
            yt, ht = e["young_lost_ticks_trace"], e["young_held_ticks_trace"]
            yw, hw = e["young_lost_ticks_windows"], e["young_held_ticks_windows"]
            where = trace.split("_")[1]
            print(
                f"{name:18s} {where:12s} {e['expected']:8.1f} → {e['seen']:3d} of {e['priced']:4d}"
                f" {ratio:>5s}   trace {yt}/{ht} ({100 * yt / max(ht, 1):.1f}%)"
                f"  windows {yw}/{hw} ({100 * yw / max(hw, 1):.1f}%)"
            )
            dt, tt, dw, tw = (
                e["drop_ticks_trace"],
                e["held_ticks_trace"],
                e["drop_ticks_windows"],
                e["held_ticks_windows"],
            )
            print(
                f"{'':31s} events at any age: trace {dt}/{tt} ({100 * dt / max(tt, 1):.1f}%, each "
                f"{100 * e['event_share_trace']:.0f}% of the pool)  windows {dw}/{tw} "
                f"({100 * dw / max(tw, 1):.1f}%, {100 * e['event_share_windows']:.0f}%)"
            )
            zs = "  ".join(
                f"{p} {v['expected']:.1f}→{v['seen']} ({v['z']:+.1f})" for p, v in e["per_policy"].items()
            )
            print(f"{'':31s} z: independent {e['z_independent']:+.1f}, shared {e['z_shared']:+.1f};  {zs}")
    targets = {"risk_ratio": "reported: lost tries expected over seen (1 is right)"}
    path = write(
        "risk-windows", targets, table, {"young_ticks": YOUNG, "admission_sha": sources}, out=args.out
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
