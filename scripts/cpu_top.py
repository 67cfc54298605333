"""Per-process CPU use, sampled from /proc every INTERVAL seconds while a benchmark runs:
which process is the bottleneck (the engine child near 100% means the engine paces the
streams; an API process near 100% means it does). Linux only; stops on SIGTERM/SIGINT.

    python scripts/cpu_top.py --interval 2 --top 12 > cpu.log &   # then the benchmark; kill %1
"""
import argparse
import os
import signal
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_ticks() -> dict[int, int]:
    ticks = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks[int(name)] = int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return ticks


def _command(pid: int, width: int = 110) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:width]
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--top", type=int, default=12, help="processes shown per sample")
    parser.add_argument("--min-percent", type=float, default=5.0, help="hide processes below this CPU %%")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    before, t0 = _cpu_ticks(), time.monotonic()
    try:
        while True:
            time.sleep(args.interval)
            now, t1 = _cpu_ticks(), time.monotonic()
            busy = sorted(((now[p] - before.get(p, now[p])) / TICKS / (t1 - t0) * 100, p) for p in now)[::-1]
            shown = [(pct, p) for pct, p in busy[:args.top] if pct >= args.min_percent]
            if shown:
                print(time.strftime("%H:%M:%S"), "total %.0f%%" % sum(pct for pct, _ in busy), flush=False)
                for pct, pid in shown:
                    print(f"  {pct:5.0f}%  {pid:>7}  {_command(pid)}")
                sys.stdout.flush()
            before, t0 = now, t1
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
