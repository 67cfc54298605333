"""Experiment: give an engine process a physical core of its own. Pins every thread of
PID to one core (its logical CPUs) and moves every other thread on the machine (some
refuse: kernel threads) off it; processes started later inherit their parent's mask.
Tests whether the serving path's slower steps come from sharing the engine's core.

    python scripts/pin_engine_cpu.py ENGINE_PID [--cpu N]   # root on the GPU host
"""
import argparse
import os


def _siblings(cpu: int) -> set[int]:
    with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
        text = f.read().strip()
    found = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--cpu", type=int, default=None, help="the engine's CPU (default: the highest numbered)")
    args = parser.parse_args()
    cpus = os.sched_getaffinity(0)
    cpu = max(cpus) if args.cpu is None else args.cpu
    core = _siblings(cpu)
    rest = cpus - core
    engine_threads = set(int(t) for t in os.listdir(f"/proc/{args.pid}/task"))
    moved = refused = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{name}/task")]
        except OSError:
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(tid, core if tid in engine_threads else rest)
                moved += 1
            except OSError:
                refused += 1
    print(f"engine {args.pid} ({len(engine_threads)} threads) on the core of CPU {cpu}, {sorted(core)}, kept free of "
          f"{moved - len(engine_threads)} other threads ({refused} refused); {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
