#!/usr/bin/env python3
"""Where the device operator benchmark's GPU time goes, kernel by kernel, from the CSV that
`ncu --metrics gpu__time_duration.sum --csv --print-units base` writes (`host/gpu-check.sh
profile` makes it). Prints each kernel's total time, launches and largest launch, the largest
first, and what share of all kernel time it is.

    python3 host/gpu-profile.py ncu.csv [--top 25]
"""

import argparse
import csv
import sys
from collections import defaultdict


def kernel_times(path):
    """(kernel name, nanoseconds) for each profiled launch, in launch order."""
    header = None
    launches = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "ID":
                header = row
                continue
            if header is None or len(row) != len(header):
                continue  # the benchmark's own output, interleaved with ncu's
            record = dict(zip(header, row))
            if record.get("Metric Name") != "gpu__time_duration.sum":
                continue
            name = record["Kernel Name"].split("(")[0]
            launches.append((name, float(record["Metric Value"].replace(",", ""))))
    if header is None:
        raise SystemExit(f"{path}: no ncu CSV header (was ncu run with --csv?)")
    return launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    launches = kernel_times(args.csv)
    if not launches:
        raise SystemExit(f"{args.csv}: no kernel launches with gpu__time_duration.sum")
    total = defaultdict(float)
    count = defaultdict(int)
    largest = defaultdict(float)
    for name, ns in launches:
        total[name] += ns
        count[name] += 1
        largest[name] = max(largest[name], ns)
    all_ns = sum(total.values())
    print(f"{len(launches)} launches, {all_ns / 1e6:.2f} ms of kernel time")
    print(f"{'kernel':<32} {'total ms':>10} {'share':>7} {'launches':>9} {'largest us':>11}")
    for name in sorted(total, key=total.get, reverse=True)[: args.top]:
        print(f"{name:<32} {total[name] / 1e6:>10.2f} {100 * total[name] / all_ns:>6.1f}% "
              f"{count[name]:>9} {largest[name] / 1e3:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
