"""The peer of the no-op benchmarks, through dask.distributed's LocalCluster with the same number
of worker processes (one thread each), timed from submission to the last result:

    dask_noop.py TASKS WORKERS          TASKS independent no-op tasks
    dask_noop.py graph WORKERS          the 3-stage graph of graph.toml (4,999 + 4,999 + 2 tasks)
"""

import sys
import time

from dask.distributed import Client, LocalCluster


def noop(x):
    return x


def gather(*inputs):
    return len(inputs)


def graph(client):
    a = [client.submit(noop, i, pure=False) for i in range(4999)]
    b = [client.submit(noop, x, pure=False) for x in a]
    c = [client.submit(gather, *b, pure=False) for _ in range(2)]
    client.gather(c)


def main() -> None:
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    if len(sys.argv) > 1 and sys.argv[1] == "graph":
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
            with Client(cluster) as client:
                client.gather(client.map(noop, range(200), pure=False))  # warm-up
                started = time.perf_counter()
                graph(client)
                elapsed = time.perf_counter() - started
        print(f"dask.distributed 3-stage graph of 10000 no-op tasks, {workers} workers: {elapsed:.3f} s "
              f"({10_000 / elapsed:.0f} tasks/s)")
        return
    tasks = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
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
