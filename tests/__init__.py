"""The test suite.

Before anything loads torch (its OpenMP runtime reads this once, as it loads): idle OpenMP
threads sleep at once instead of spinning, in the test process and in every worker it starts
(they inherit the environment). A sync run gives each worker both cores in turn; spinning
threads of the idle one, of the test process and of a shared machine's other work took the
cores the busy one waited on (an unmeasured share of the sync-mode tests' time on a loaded
machine: timed only beside other jobs). A value set outside wins."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
