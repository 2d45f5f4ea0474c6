"""CPU seconds of each test, for finding what makes `make test` slow (`make test-cpu-time`).

Wall times mislead on a shared 2-core machine; CPU seconds do not: each test's are its process's user
and system time plus those of the commands it ran (training CLIs, notebook kernels), appended as
`nodeid<TAB>cpu_s<TAB>wall_s` to the file named by TFM_CPU_TIME_FILE. `python tests/cpu_time.py FILE`
sums them by file, largest first."""
import os
import resource
import sys
import time

import pytest


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_s(), time.time()
    yield
    with open(os.environ["TFM_CPU_TIME_FILE"], "a") as rows:  # one short line: appends do not interleave
        rows.write(f"{item.nodeid}\t{_cpu_s() - cpu:.2f}\t{time.time() - wall:.2f}\n")


def by_file(path: str, top: int = 30) -> str:
    """The `top` files of most CPU seconds: seconds, tests, name; then the total."""
    files, total = {}, 0.0
    for line in open(path):
        nodeid, cpu, _ = line.rstrip("\n").split("\t")
        seconds, count = files.get(nodeid.split("::")[0], (0.0, 0))
        files[nodeid.split("::")[0]] = (seconds + float(cpu), count + 1)
        total += float(cpu)
    ranked = sorted(files.items(), key=lambda kv: -kv[1][0])[:top]
    return "\n".join([f"{s:8.1f} s {n:5d} tests  {f}" for f, (s, n) in ranked] + [f"{total:8.1f} s in all"])


if __name__ == "__main__":
    print(by_file(sys.argv[1]))
