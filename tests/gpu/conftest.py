"""The GPU tests run the CUDA allocator as ``ulysses-sp train`` does (expandable segments, unless configured),
since the planner's figures they check assume it; set before any test touches CUDA.

``gpu_record``: a test's measurements, appended as one JSON line to the file ``$GPU_RECORD`` names (the GPU
session script sets it), so that a passing test's numbers reach the lease's results too; without it, nothing.

SIGINT is Ctrl-C again even where the session script was started with it ignored (a background job without job
control): its time limit interrupts a step, and pytest then still prints the failures so far and writes its XML."""

import json
import os
import signal

import pytest

from ulysses_sp.cli import use_expandable_segments

use_expandable_segments(os.environ)
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def gpu_record(request):
    def record(**values) -> None:
        path = os.environ.get("GPU_RECORD")
        if path:
            with open(path, "a") as out:
                out.write(json.dumps({"test": request.node.nodeid, **values}, default=str) + "\n")

    return record
