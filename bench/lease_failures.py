"""A pytest plugin for runs on a lent GPU machine (bench/gpu_lease.sh): each failure's report is appended to
$LEASE_FAILURES the moment it happens, so a run cut off at the call's time limit still says what failed and why
(pytest's own summary and --junitxml are written only at the end).

    python -m pytest -p bench.lease_failures ...
"""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("LEASE_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f}s)\n{report.longreprtext}\n\n")
