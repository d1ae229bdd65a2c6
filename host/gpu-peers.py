#!/usr/bin/env python3
"""The peer of the device operator benchmark: the same operators in cuDF on the same card.

Builds the table `host/src/gpu/bench.rs` builds (its values are a function of the row number:
SplitMix64 of `row * 8 + column`), puts it on the GPU with cuDF, and times the haversine pass, a
group-by (mean of pickup_longitude by passenger_count), an inner join with the drivers table, a
sort and a 16-way hash-partition, each the best of several runs after a warm-up, synchronising
the device after each. With `--wrk FILE` (the benchmark's output) it prints wrk's time next to
cuDF's for each operator. BENCH_ROWS sets the row count (20 M), as for the benchmark.

Where cuDF cannot be imported it says so and exits 0: the GPU machines lent to this project have
no package index, so cuDF must be carried there as wheels (docs/gpu.md, "On a machine with a
GPU").
"""

import argparse
import math
import os
import re
import sys
import time

import numpy as np

MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def uniform(rows, column):
    """Value `column` of rows 0..rows, as bench.rs's `uniform`: uniform in [0, 1)."""
    with np.errstate(over="ignore"):
        z = np.arange(rows, dtype=np.uint64) * np.uint64(8) + np.uint64(column)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def taxi(rows):
    drivers = max(rows // 4, 1)
    return {
        "pickup_longitude": -74.0 + uniform(rows, 0) * 0.3,
        "pickup_latitude": 40.6 + uniform(rows, 1) * 0.3,
        "dropoff_longitude": -74.0 + uniform(rows, 2) * 0.3,
        "dropoff_latitude": 40.6 + uniform(rows, 3) * 0.3,
        "passenger_count": (uniform(rows, 4) * 6.0).astype(np.int32) + 1,
        "driver": (np.arange(rows, dtype=np.int64) * 7919) % drivers,
    }


def best(runs, sync, f):
    f()
    sync()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        f()
        sync()
        times.append(time.perf_counter() - started)
    return min(times)


def wrk_times(path):
    """Operator -> seconds from the benchmark's lines `  NAME gpu X ms   cpu Y ms ...`."""
    times = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\s+(\S+)\s+gpu\s+([0-9.]+) ms", line)
            if m:
                times[m.group(1)] = float(m.group(2)) / 1e3
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrk", help="the device operator benchmark's output, to compare")
    args = parser.parse_args()
    try:
        import cudf
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no peer here
        print(f"SKIPPED cuDF peer: cuDF cannot be imported here ({type(e).__name__}: {e})")
        return 0
    rows = int(os.environ.get("BENCH_ROWS", "20000000"))
    data = taxi(rows)
    trips = cudf.DataFrame(data)
    drivers = cudf.DataFrame({"driver": np.arange(max(rows // 4, 1), dtype=np.int64)})
    sync = cupy.cuda.runtime.deviceSynchronize
    rad = math.pi / 180.0

    def haversine():
        lat1 = trips["pickup_latitude"] * rad
        lat2 = trips["dropoff_latitude"] * rad
        dlat = np.sin((lat2 - lat1) / 2.0)
        dlon = np.sin((trips["dropoff_longitude"] * rad - trips["pickup_longitude"] * rad) / 2.0)
        a = dlat * dlat + (np.cos(lat1) * np.cos(lat2)) * (dlon * dlon)
        return (2.0 * 6371.0) * np.arcsin(np.sqrt(a))

    operators = {
        "haversine": (5, haversine),
        "group-by": (
            5,
            lambda: trips.groupby("passenger_count").agg({"pickup_longitude": "mean"}),
        ),
        "join": (3, lambda: trips.merge(drivers, on="driver", how="inner")),
        "sort": (3, lambda: trips.sort_values("pickup_longitude")),
        "hash-partition": (3, lambda: trips.partition_by_hash(["driver"], 16)),
    }
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"cuDF {cudf.__version__} on {device} ({rows} rows)")
    wrk = wrk_times(args.wrk) if args.wrk else {}
    for name, (runs, f) in operators.items():
        seconds = best(runs, sync, f)
        line = f"  {name:<16} cudf {seconds * 1e3:>9.2f} ms"
        if name in wrk:
            line += f"   wrk {wrk[name] * 1e3:>9.2f} ms   wrk time / cuDF time {wrk[name] / seconds:>6.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
