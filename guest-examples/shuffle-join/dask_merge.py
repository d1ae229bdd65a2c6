"""The peer of the shuffle-join benchmark: the same join (trips with drivers on driver_id, then
trips, fare sum and rating sum per driver shift) through dask.distributed's LocalCluster with the
same number of worker processes (one thread each) and its P2P shuffle, timed from building the
graph to the result, on the same Parquet files.

    dask_merge.py TRIPS_DIR DRIVERS_DIR WORKERS
"""

import sys
import time

import dask
import dask.dataframe as dd
from dask.distributed import Client, LocalCluster


def main() -> None:
    trips_dir, drivers_dir, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster):
        with dask.config.set({"dataframe.shuffle.method": "p2p"}):
            started = time.perf_counter()
            trips = dd.read_parquet(trips_dir, columns=["driver_id", "fare_amount"])
            drivers = dd.read_parquet(drivers_dir, columns=["driver_id", "rating", "shift"])
            joined = trips.merge(drivers, on="driver_id", how="inner", shuffle_method="p2p")
            result = joined.groupby("shift").agg(
                trips=("fare_amount", "count"),
                fare_sum=("fare_amount", "sum"),
                rating_sum=("rating", "sum"),
            ).compute().sort_index()
            elapsed = time.perf_counter() - started
    rows = int(result["trips"].sum())
    print(result.to_string())
    print(f"dask.distributed p2p shuffle merge, {workers} workers: {elapsed:.3f} s "
          f"({rows / elapsed:,.0f} joined rows/s)")


if __name__ == "__main__":
    main()
