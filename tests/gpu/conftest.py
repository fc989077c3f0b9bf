"""The GPU tests run the CUDA allocator as ``ulysses-sp train`` does (expandable segments, unless configured),
since the planner's figures they check assume it; set before any test touches CUDA."""

import os

from ulysses_sp.cli import use_expandable_segments

use_expandable_segments(os.environ)
