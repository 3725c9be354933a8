"""Plan a scheduler policy in the simulator: sweep the prefill watermark and the
batch budget on a bundled trace and compare TTFT, TPOT and preemptions.

    python examples/simulate.py [TRACE]
"""

from __future__ import annotations

import sys
from pathlib import Path

from deepinfer import EngineConfig
from sim import load_trace, simulate

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "traces" / "azure_code_small.json"
    # 4x faster arrivals and a small cache, so that the policies actually differ.
    trace = load_trace(path, time_scale=0.25)
    print(
        f"{'watermark':>9} {'batch tokens':>12} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
        f"{'TPOT mean ms':>12} {'preemptions':>11}"
    )
    for watermark in (0.7, 0.9, 1.0):
        for budget in (2048, 8192):
            engine = EngineConfig(
                num_gpu_blocks=600, prefill_watermark=watermark, max_num_batched_tokens=budget
            )
            s = simulate(trace, model="moonlight-16b-a3b", hardware="h200", engine=engine).summary
            print(
                f"{watermark:9.2f} {budget:12d} {s['ttft_ms_p50']:11.1f} {s['ttft_ms_p99']:11.1f} "
                f"{s['tpot_ms_mean']:12.2f} {s['total_preemptions']:11d}"
            )


if __name__ == "__main__":
    main()
