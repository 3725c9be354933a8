"""Rebuild the bundled traces from the full public files.

    python traces/make_bundled.py [SHARED_TRACES_DIR]

SHARED_TRACES_DIR defaults to ../shared/traces beside the repository (it holds
azure2023_code.csv and mooncake_fast25_conversation_trace.jsonl, see its
README.md). The output is deterministic: running this again rewrites the
same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "traces"

AZURE_REF = "Azure/AzurePublicDataset @ b469a113cedca53ddc3bdea71a143dc4b7d8700c"
MOONCAKE_REF = "kvcache-ai/Mooncake @ 3b5a594133958449a1feaf1c9e0fc1b553e34a28"

# (file in SHARED_TRACES_DIR, bundled file, number of requests, source line)
AZURE = (
    "azure2023_code.csv",
    "azure_code_small.json",
    400,
    (
        f"Azure LLM inference trace 2023, code ({AZURE_REF} : "
        "data/AzureLLMInferenceTrace_code.csv), first 400 requests; CC-BY-4.0, "
        "cite Patel et al., Splitwise, ISCA 2024"
    ),
)
MOONCAKE = (
    "mooncake_fast25_conversation_trace.jsonl",
    "mooncake_conversation_small.jsonl",
    300,
    (
        f"Mooncake FAST'25 conversation trace ({MOONCAKE_REF} : "
        "FAST25-release/traces/conversation_trace.jsonl), first 300 requests; Apache-2.0"
    ),
)


def main(shared: Path) -> None:
    # Imported here, after the path fix, so the script runs from any directory.
    sys.path.insert(0, str(REPO))
    from sim.traces import Trace, load_trace, write_native

    for src, dst, n, source in (AZURE, MOONCAKE):
        full = load_trace(shared / src, max_requests=n)
        trace = Trace(Path(dst).name.split(".")[0], source, full.requests)
        write_native(trace, HERE / dst)
        print(f"{HERE / dst}: {len(trace)} requests over {trace.duration:.1f} s")


if __name__ == "__main__":
    default = REPO.parent / "shared" / "traces"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
