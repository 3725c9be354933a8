"""Request traces for the simulator.

Every supported file becomes a `Trace` of `TraceRequest`s (sizes, arrival,
optional prefix-block ids); `SyntheticPrompt` turns a request into prompt
content the prefix cache can hash. Formats and their mapping: traces/README.md.

- model.py     TraceRequest, Trace, TraceError
- loader.py    load_trace (detect, load, window, scale)
- detect.py    format detection from the first line
- native.py    the native JSON / JSONL format, and write_native
- azure.py, mooncake.py, burstgpt.py, vidur.py   public formats
- synthetic.py SyntheticPrompt: deterministic token content from prefix blocks
- retime.py    retimed, offline, poisson: the same sizes at new arrival times
"""

from sim.traces.detect import detect_format
from sim.traces.loader import FORMATS, load_trace, select
from sim.traces.model import Trace, TraceError, TraceRequest
from sim.traces.native import write_native
from sim.traces.retime import offline, poisson, retimed
from sim.traces.synthetic import SyntheticPrompt

__all__ = [
    "FORMATS",
    "SyntheticPrompt",
    "Trace",
    "TraceError",
    "TraceRequest",
    "detect_format",
    "load_trace",
    "offline",
    "poisson",
    "retimed",
    "select",
    "write_native",
]
