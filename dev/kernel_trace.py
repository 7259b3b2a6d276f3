"""The CUDA kernels one call runs, from torch.profiler's chrome trace (for the dev probes' --trace listings).

Entry point: ``kernel_events(fn, *args, queued=False) -> list[dict]``, the trace's kernel events in start order.
"""
import json
import tempfile

import torch


def kernel_events(fn, *args, queued: bool = False) -> list[dict]:
    """`fn(*args)`'s kernels, each the chrome trace's event (name, ts, dur, args: grid, block, stream...). With
    `queued`, the call is queued behind a 50 ms GPU spin, so that the timeline is the GPU's, not the host's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        if queued:
            torch.cuda._sleep(50_000_000)
        fn(*args)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as exported:
            events = json.load(exported)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and not (queued and "sleep" in e["name"])]
    return sorted(kernels, key=lambda e: e["ts"])
