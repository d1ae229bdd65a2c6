#!/usr/bin/env python3
"""The engine benchmark: wrk against Polars, DuckDB, DataFusion and cuDF, side by side in one run.

Runs four queries over the same Parquet files (data/bench, written by `wrk gen-taxi`): the
haversine pass, a group-by, a join with the 5 M-row drivers table and a pure scan. wrk runs each
as a Wasm job on a local cluster of WORKERS workers (`wrk up`); the peers run the same query in
this process with the same number of threads. Each query runs RUNS times per engine after one
warm-up run; the best time counts. Prints rows/second, wrk's ratio to each peer, whether the
answers agree, and the scan's bytes/second next to this machine's memory bandwidth (the best of
three sums of a 1 GiB float64 array with numpy, one core). The scan runs a second time over
`fare_amount` already in memory: wrk over a dataset persisted in its workers, each peer over a
table it loaded (wrk's time is given both for the whole `wrk submit` command and for the job
alone, as the command reports it).

Peers that cannot be imported are left out and named. cuDF is a peer where it imports (on a GPU
machine: `host/gpu-check.sh engine` runs this with wrk's worker on the GPU, `WRK_BENCH_DEVICE`,
next to cuDF on the same card). `WRK` and `WRK_BENCH_MODULE` name a prebuilt `wrk` and guest
(the bundle of `host/gpu-bundle.sh`) instead of the ones `bench.sh` builds.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREADS = int(os.environ.get("WORKERS", "2"))
os.environ["POLARS_MAX_THREADS"] = str(THREADS)

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


def optional(module):
    """The peer's module, or None where it cannot be imported here."""
    try:
        return __import__(module)
    except Exception:  # noqa: BLE001 - any import failure leaves the peer out
        return None


pl = optional("polars")
duckdb = optional("duckdb")
datafusion = optional("datafusion")
cudf = optional("cudf")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "bench"
WRK = os.environ.get("WRK") or ROOT / "target" / "release" / "wrk"
# A prebuilt guest for every job (`wrk submit --module`); without it the job files' own path.
MODULE = ["--module", os.environ["WRK_BENCH_MODULE"]] if os.environ.get("WRK_BENCH_MODULE") else []
RUNS = int(os.environ.get("RUNS", "3"))
QUERIES = ["haversine", "groupby", "join", "scan"]
RAD = 0.017453292519943295  # pi / 180, as the guest multiplies it


def distance_sql():
    lat1, lat2 = f"(pickup_latitude * {RAD})", f"(dropoff_latitude * {RAD})"
    dlat = f"sin(({lat2} - {lat1}) / 2)"
    dlon = f"sin(((dropoff_longitude * {RAD}) - (pickup_longitude * {RAD})) / 2)"
    a = f"({dlat} * {dlat} + cos({lat1}) * cos({lat2}) * {dlon} * {dlon})"
    return f"(2 * 6371.0 * asin(sqrt({a})))"


SQL = {
    "haversine": f"SELECT sum({distance_sql()}) AS distance_km, count(*) AS trips FROM trips",
    "groupby": f"SELECT passenger_count, sum(fare_amount) AS fare_sum, avg({distance_sql()}) "
    "AS mean_distance_km FROM trips GROUP BY passenger_count ORDER BY passenger_count",
    "join": "SELECT shift, sum(fare_amount) AS fare_sum, count(*) AS trips FROM trips "
    "JOIN drivers ON trips.driver_id = drivers.driver_id GROUP BY shift ORDER BY shift",
    "scan": "SELECT sum(fare_amount) AS fare_sum FROM trips WHERE fare_amount > 30",
}


def polars_query(query):
    trips = pl.scan_parquet(str(DATA / "taxi" / "*.parquet"))
    col = pl.col
    lat1, lat2 = col("pickup_latitude") * RAD, col("dropoff_latitude") * RAD
    dlat = ((lat2 - lat1) / 2).sin()
    dlon = ((col("dropoff_longitude") * RAD - col("pickup_longitude") * RAD) / 2).sin()
    distance = 2 * 6371.0 * (dlat * dlat + lat1.cos() * lat2.cos() * dlon * dlon).sqrt().arcsin()
    if query == "haversine":
        plan = trips.select(distance.sum().alias("distance_km"), pl.len().alias("trips"))
    elif query == "groupby":
        plan = (
            trips.group_by("passenger_count")
            .agg(col("fare_amount").sum().alias("fare_sum"), distance.mean().alias("mean_distance_km"))
            .sort("passenger_count")
        )
    elif query == "join":
        drivers = pl.scan_parquet(str(DATA / "drivers" / "*.parquet"))
        plan = (
            trips.join(drivers, on="driver_id")
            .group_by("shift")
            .agg(col("fare_amount").sum().alias("fare_sum"), pl.len().alias("trips"))
            .sort("shift")
        )
    else:
        plan = trips.filter(col("fare_amount") > 30).select(col("fare_amount").sum().alias("fare_sum"))
    return plan.collect().rows()


def duckdb_engine():
    con = duckdb.connect()
    con.execute(f"SET threads = {THREADS}")
    con.execute(f"CREATE VIEW trips AS SELECT * FROM read_parquet('{DATA}/taxi/*.parquet')")
    con.execute(f"CREATE VIEW drivers AS SELECT * FROM read_parquet('{DATA}/drivers/*.parquet')")
    return lambda query: con.execute(SQL[query]).fetchall()


def datafusion_engine():
    config = datafusion.SessionConfig().with_target_partitions(THREADS)
    ctx = datafusion.SessionContext(config)
    ctx.register_parquet("trips", str(DATA / "taxi") + "/")
    ctx.register_parquet("drivers", str(DATA / "drivers") + "/")

    def run(query):
        table = ctx.sql(SQL[query]).to_arrow_table()
        return [tuple(row.values()) for row in table.to_pylist()]

    return run


def cudf_distance(trips):
    """The haversine distance of each trip, in kilometres, on the GPU."""
    lat1, lat2 = trips["pickup_latitude"] * RAD, trips["dropoff_latitude"] * RAD
    dlat = np.sin((lat2 - lat1) / 2)
    dlon = np.sin((trips["dropoff_longitude"] * RAD - trips["pickup_longitude"] * RAD) / 2)
    return 2 * 6371.0 * np.arcsin(np.sqrt(dlat * dlat + np.cos(lat1) * np.cos(lat2) * dlon * dlon))


def cudf_rows(frame):
    return [tuple(row) for row in frame.to_pandas().itertuples(index=False)]


def cudf_query(query):
    """The query in cuDF: the Parquet files read onto the GPU, the work done there."""
    files = sorted(str(f) for f in (DATA / "taxi").glob("*.parquet"))
    coordinates = ["pickup_longitude", "pickup_latitude", "dropoff_longitude", "dropoff_latitude"]
    if query == "haversine":
        trips = cudf.read_parquet(files, columns=coordinates)
        return [(float(cudf_distance(trips).sum()), len(trips))]
    if query == "groupby":
        trips = cudf.read_parquet(files, columns=coordinates + ["passenger_count", "fare_amount"])
        trips["distance_km"] = cudf_distance(trips)
        grouped = trips.groupby("passenger_count").agg(
            fare_sum=("fare_amount", "sum"), mean_distance_km=("distance_km", "mean"))
        return cudf_rows(grouped.sort_index().reset_index())
    if query == "join":
        trips = cudf.read_parquet(files, columns=["driver_id", "fare_amount"])
        drivers = cudf.read_parquet(sorted(str(f) for f in (DATA / "drivers").glob("*.parquet")),
                                    columns=["driver_id", "shift"])
        joined = trips.merge(drivers, on="driver_id")
        grouped = joined.groupby("shift").agg(
            fare_sum=("fare_amount", "sum"), trips=("fare_amount", "count"))
        return cudf_rows(grouped.sort_index().reset_index())
    fares = cudf.read_parquet(files, columns=["fare_amount"])["fare_amount"]
    return [(float(fares[fares > 30].sum()),)]


class WrkCluster:
    """A `wrk up` local cluster; queries are `wrk submit --scheduler` runs against it."""

    def __init__(self, workers):
        self.url = "http://127.0.0.1:7171"
        self.out = tempfile.mkdtemp(prefix="wrk-bench-")
        # WRK_BENCH_DEVICE (default `cpu`): the first worker's device, e.g. `gpu:0` with WORKERS=1
        # to run wrk's side on the GPU; a GPU worker compiles its kernels and self-tests first.
        device = os.environ.get("WRK_BENCH_DEVICE", "cpu")
        # WRK_BENCH_SLOTS (default 1): tasks at once per worker; a lone GPU worker wants several,
        # so that its tasks' Parquet decoding (on the host) uses more than one core.
        slots = os.environ.get("WRK_BENCH_SLOTS", "1")
        self.process = subprocess.Popen(
            [WRK, "up", "--workers", str(workers), "--slots", slots, "--listen", "127.0.0.1:7171",
             "--http-listen", "127.0.0.1:8789", "--cache-dir", self.out + "/cache",
             "--device", device],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + (60 if device == "cpu" else 240)
        while time.time() < deadline:
            status = subprocess.run([WRK, "status", "--scheduler", self.url, "--output", "json"],
                                    capture_output=True, text=True)
            if status.returncode == 0 and len(json.loads(status.stdout)["workers"]) >= workers:
                return
            time.sleep(0.3)
        raise SystemExit("wrk up did not come up in time:\n" + status.stdout + status.stderr)

    def __call__(self, query):
        result = Path(self.out) / f"{query}.parquet"
        job = ROOT / "guest-examples" / "engine-bench" / f"{query}.toml"
        run = subprocess.run([WRK, "submit", job, "--scheduler", self.url, "--quiet", *MODULE,
                              "--output", result], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"wrk query {query} failed:\n{run.stderr}")
        return [tuple(r.values()) for r in pq.read_table(result).to_pylist()]

    def submit(self, job, *args):
        run = subprocess.run([WRK, "submit", ROOT / "guest-examples" / "engine-bench" / job,
                              "--scheduler", self.url, "--quiet", *MODULE, *args],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"wrk job {job} failed:\n{run.stderr}")
        return run.stderr

    def scan_memory(self):
        """The scan over the fares persisted in the workers' memory: (the job's own seconds as
        `wrk submit` reports them, the answer); the caller times the whole command."""
        result = Path(self.out) / "scan-memory.parquet"
        report = self.submit("scan-memory.toml", "--output", result)
        job_seconds = float(re.search(r"succeeded: \d+ tasks in ([0-9.]+) s", report).group(1))
        return job_seconds, [tuple(r.values()) for r in pq.read_table(result).to_pylist()]

    def close(self):
        self.process.terminate()
        self.process.wait()


def timed(run, query):
    run(query)  # warm-up: caches, compiled module, page cache
    best, answer = float("inf"), None
    for _ in range(RUNS):
        start = time.perf_counter()
        answer = run(query)
        best = min(best, time.perf_counter() - start)
    return best, answer


def same(a, b):
    if len(a) != len(b):
        return False
    for row_a, row_b in zip(a, b):
        for x, y in zip(row_a, row_b):
            if isinstance(x, float) or isinstance(y, float):
                if abs(float(x) - float(y)) > 1e-6 * max(1.0, abs(float(y))):
                    return False
            elif x != y:
                return False
    return True


def scan_from_memory(cluster, peers):
    """The scan over `fare_amount` already in memory: wrk over a persisted dataset (loaded by
    `scan-load.toml`, persisted as `bench-fares`), each of `peers` over a table it loaded itself.
    Returns {engine: (seconds, answer)}, and wrk's best job time as `wrk submit` reports it."""
    cluster.submit("scan-load.toml", "--persist", "bench-fares")
    files = str(DATA / "taxi" / "*.parquet")
    sql = "SELECT sum(fare_amount) AS fare_sum FROM fares WHERE fare_amount > 30"
    job_times = []

    def wrk(_):
        seconds, answer = cluster.scan_memory()
        job_times.append(seconds)
        return answer

    def polars_scan():
        fares = pl.read_parquet(files, columns=["fare_amount"])
        return lambda _: fares.filter(pl.col("fare_amount") > 30).select(
            pl.col("fare_amount").sum()).rows()

    def duckdb_scan():
        con = duckdb.connect()
        con.execute(f"SET threads = {THREADS}")
        con.execute(f"CREATE TABLE fares AS SELECT fare_amount FROM read_parquet('{files}')")
        return lambda _: con.execute(sql).fetchall()

    def datafusion_scan():
        ctx = datafusion.SessionContext(datafusion.SessionConfig().with_target_partitions(THREADS))
        table = pq.read_table(DATA / "taxi", columns=["fare_amount"])
        ctx.register_record_batches("fares", [table.to_batches()])
        return lambda _: [tuple(r.values()) for r in ctx.sql(sql).to_arrow_table().to_pylist()]

    def cudf_scan():
        fares = cudf.read_parquet(sorted(str(f) for f in (DATA / "taxi").glob("*.parquet")),
                                  columns=["fare_amount"])["fare_amount"]
        return lambda _: [(float(fares[fares > 30].sum()),)]

    loaders = {"polars": polars_scan, "duckdb": duckdb_scan, "datafusion": datafusion_scan,
               "cudf": cudf_scan}
    engines = {"wrk": wrk, **{name: loaders[name]() for name in peers}}
    results = {name: timed(run, "scan") for name, run in engines.items()}
    return results, min(job_times)


def memory_bandwidth():
    data = np.ones(1 << 27)  # 1 GiB of float64, touched once
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def main():
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in sorted((DATA / "taxi").glob("*.parquet")))
    print(f"machine: {os.cpu_count()} cores, {THREADS} workers/threads per engine; {rows:,} trips; "
          f"best of {RUNS} runs after a warm-up")
    modules = {"polars": pl, "duckdb": duckdb, "datafusion": datafusion, "cudf": cudf}
    peers = [name for name, module in modules.items() if module is not None]
    print("versions: " + ", ".join(f"{n} {modules[n].__version__}" for n in peers) +
          "".join(f"; {n} not installed" for n, m in modules.items() if m is None))
    if not peers:
        print("no peer engine can be imported: wrk's figures alone")
    makers = {"polars": lambda: polars_query, "duckdb": duckdb_engine,
              "datafusion": datafusion_engine, "cudf": lambda: cudf_query}
    cluster = WrkCluster(THREADS)
    engines = {"wrk": cluster, **{name: makers[name]() for name in peers}}
    results = {}
    try:
        for query in QUERIES:
            for name, run in engines.items():
                results[(query, name)] = timed(run, query)
        in_memory, wrk_job_seconds = scan_from_memory(cluster, peers)
    finally:
        cluster.close()
    header = f"{'query':<10} " + " ".join(f"{n + ' rows/s':>18}" for n in engines) + " " + \
        " ".join(f"{'wrk/' + n:>14}" for n in peers) + "  answers"
    print(header)
    for query in QUERIES:
        wrk_time, wrk_answer = results[(query, "wrk")]
        cells = " ".join(f"{rows / results[(query, n)][0]:>18,.0f}" for n in engines)
        ratios = " ".join(f"{results[(query, n)][0] / wrk_time:>13.2f}x" for n in peers)
        agree = all(same(wrk_answer, results[(query, n)][1]) for n in peers)
        verdict = ("agree" if agree else "DIFFER") if peers else "no peer"
        print(f"{query:<10} {cells} {ratios}  {verdict}")
        if not agree:
            for name in engines:
                print(f"    {name}: {results[(query, name)][1]}", file=sys.stderr)
    cells = " ".join(f"{rows / in_memory[n][0]:>18,.0f}" for n in engines)
    ratios = " ".join(f"{in_memory[n][0] / in_memory['wrk'][0]:>13.2f}x" for n in peers)
    agree = all(same(in_memory["wrk"][1], in_memory[n][1]) for n in peers)
    verdict = ("agree" if agree else "DIFFER") if peers else "no peer"
    print(f"{'scan (mem)':<10} {cells} {ratios}  {verdict}")
    bandwidth = memory_bandwidth()
    column_bytes = rows * 8
    print(f"memory bandwidth (1 GiB numpy sum, one core): {bandwidth / 2**30:.2f} GiB/s")
    for label, seconds in [
        ("scan from Parquet, the command", results[("scan", "wrk")][0]),
        ("scan from memory, the command", in_memory["wrk"][0]),
        ("scan from memory, the job", wrk_job_seconds),
    ]:
        rate = column_bytes / seconds
        print(f"{label}: wrk reads fare_amount at {rate / 2**30:.2f} GiB/s, "
              f"{bandwidth / rate:.1f}x from memory bandwidth")


if __name__ == "__main__":
    main()
