"""The peer of the no-op benchmark: N no-op tasks through dask.distributed's LocalCluster with the
same number of worker processes (one thread each), timed from submission to the last result."""

import sys
import time

from dask.distributed import Client, LocalCluster


def noop(x):
    return x


def main() -> None:
    tasks = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            client.gather(client.map(noop, range(200), pure=False))  # warm-up
            started = time.perf_counter()
            futures = client.map(noop, range(tasks), pure=False)
            client.gather(futures)
            elapsed = time.perf_counter() - started
    print(f"dask.distributed {tasks} no-op tasks, {workers} workers: {elapsed:.3f} s ({tasks / elapsed:.0f} tasks/s)")


if __name__ == "__main__":
    main()
